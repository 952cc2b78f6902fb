"""Every running request's block table, kept between steps in one array per KV-cache group.

The scheduler sends a request's whole table once and then only the ids it appends (tables are
append-only), so a step gathers its requests' rows rather than rebuilding a table from Python
lists: at 256 decoding requests that rebuild was most of preparing a step's inputs.
"""
from __future__ import annotations

import numpy as np

_MIN_ROWS, _MIN_COLS = 64, 64


class BlockTables:
    """A row per request in each group's array; a freed row is zeroed, so a gathered table is
    zero past each request's last block, as the kernels and the reference expect."""

    def __init__(self) -> None:
        self.tables: list[np.ndarray] = []  # per group: [rows, cols] int64
        self.lengths: list[np.ndarray] = []  # per group: [rows] blocks in each row
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []

    def add(self, request_id: str, block_ids: tuple[list[int], ...]) -> None:
        """A new request, or a resumed one sent whole again."""
        if not self.tables:
            self.tables = [np.zeros((_MIN_ROWS, _MIN_COLS), np.int64) for _ in block_ids]
            self.lengths = [np.zeros(_MIN_ROWS, np.int64) for _ in block_ids]
            self.free_rows = list(range(_MIN_ROWS - 1, -1, -1))
        self.remove(request_id)
        if not self.free_rows:
            self._grow_rows()
        row = self.row_of[request_id] = self.free_rows.pop()
        for g, ids in enumerate(block_ids):
            self._write(g, row, ids)

    def append(self, request_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        row = self.row_of[request_id]
        for g, ids in enumerate(new_block_ids):
            if ids:
                self._write(g, row, ids)

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        for table, lengths in zip(self.tables, self.lengths):
            table[row, : lengths[row]] = 0
            lengths[row] = 0
        self.free_rows.append(row)

    def gather(self, request_ids: list[str], group: int) -> np.ndarray:
        """The tables of ``request_ids`` in that order: [len(request_ids), their most blocks]."""
        rows = np.fromiter((self.row_of[r] for r in request_ids), np.int64, count=len(request_ids))
        width = int(self.lengths[group][rows].max())
        return self.tables[group][rows, :width]  # fancy indexing copies

    def _write(self, group: int, row: int, ids: list[int]) -> None:
        start = int(self.lengths[group][row])
        end = start + len(ids)
        if end > self.tables[group].shape[1]:
            self._grow_cols(group, end)
        self.tables[group][row, start:end] = ids
        self.lengths[group][row] = end

    def _grow_rows(self) -> None:
        rows = self.tables[0].shape[0]
        self.tables = [np.concatenate([t, np.zeros_like(t)]) for t in self.tables]
        self.lengths = [np.concatenate([n, np.zeros_like(n)]) for n in self.lengths]
        self.free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def _grow_cols(self, group: int, needed: int) -> None:
        table = self.tables[group]
        cols = max(needed, 2 * table.shape[1])
        grown = np.zeros((table.shape[0], cols), np.int64)
        grown[:, : table.shape[1]] = table
        self.tables[group] = grown
