"""The bytes of the tiers under the KV pool (core/kv_offload.py decides what moves; this copies):
per key, each layer's slice of one pool block, copied out of the pool before a step overwrites the
block and back into a fresh block when a prompt hits it; and the files of the disk tier, written
and read by one thread of their own (in the order asked, so a block written is there to be read).

Every backend lays a layer's cache out as (2, kv heads, blocks, ...) (attention/*.kv_cache_shape),
an 8-bit cache as (codes, scales) of that layout: a block is the slice at BLOCK_DIM of each.

A disk file is one block of every layer: MAGIC, a little-endian u32 header length, the header
(JSON: format version, the model key, the block's key, each part's dtype and shape, the payload's
CRC-32), then the parts' bytes. It is written to a temporary name and renamed, so a crash leaves
no half file under a block's name; a file whose header or checksum does not match is deleted and
its block recomputed, never served.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, Hashable

import torch

from dabba.core.kv_offload import KVTransfers

logger = logging.getLogger("dabba")

BLOCK_DIM = 2
MAGIC = b"DABBAKV\x00"
FORMAT_VERSION = 1


def _parts(kv_caches: list[Any]) -> list[torch.Tensor]:
    return [part for cache in kv_caches for part in (cache if isinstance(cache, (tuple, list)) else (cache,))]


def _gather(parts: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Copies of the blocks of each part, block first: [n, 2, heads, ...]."""
    ids = torch.tensor(block_ids, device=parts[0].device)
    return [p.index_select(BLOCK_DIM, ids).movedim(BLOCK_DIM, 0) for p in parts]


class HostKVTier:
    def __init__(self) -> None:
        self.blocks: dict[Hashable, list[torch.Tensor]] = {}  # key -> one slice per layer and part
        self.disk: DiskStore | None = None  # set by the runner where the engine has a disk tier

    def drain(self, wait: float = 0.0) -> tuple[list[Hashable], list[Hashable]]:
        """The disk reads that ended since the last call, their blocks now here: (read, failed)."""
        if self.disk is None:
            return [], []
        read, failed = [], []
        for key, tensors in self.disk.completed(wait if self.disk.pending_reads else 0.0):
            if tensors is None:
                failed.append(key)
            else:
                self.blocks[key] = tensors
                read.append(key)
        return read, failed

    def apply(self, transfers: KVTransfers, kv_caches: list[Any]) -> None:
        """Before the forward: spills, drops, stores, writes, loads, then the disk's deletes and
        fetches (the order the core planned them in); persist() after it."""
        for key in transfers.spills:
            self.disk.write(key, self.blocks.pop(key))
        for key in transfers.drops:
            del self.blocks[key]
        parts = _parts(kv_caches)
        if transfers.stores:
            gathered = _gather(parts, [block_id for block_id, _ in transfers.stores])
            for i, (_, key) in enumerate(transfers.stores):
                self.blocks[key] = [g[i].clone() for g in gathered]
        for key in transfers.writes:
            self.disk.write(key, self.blocks[key])
        if transfers.loads:
            ids = torch.tensor([block_id for _, block_id in transfers.loads], device=parts[0].device)
            stored = [self.blocks[key] for key, _ in transfers.loads]
            for j, part in enumerate(parts):
                part.index_copy_(BLOCK_DIM, ids, torch.stack([s[j] for s in stored], dim=BLOCK_DIM))
        for key in transfers.deletes:
            self.disk.delete(key)
        for key in transfers.fetches:
            self.disk.read(key, [(p.dtype, p.shape[:BLOCK_DIM] + p.shape[BLOCK_DIM + 1:]) for p in parts])

    def persist(self, transfers: KVTransfers, kv_caches: list[Any]) -> None:
        """After the forward: the blocks it computed that the disk tier takes, copied out and written."""
        if transfers.persists:
            gathered = _gather(_parts(kv_caches), [block_id for block_id, _ in transfers.persists])
            for i, (_, key) in enumerate(transfers.persists):
                self.disk.write(key, [g[i] for g in gathered])


def disk_tier_dir(resolved: Any) -> Path:
    """The model's own directory of the disk tier: named by its key, so that no other model's
    blocks are ever looked at (and each file's header says the key again)."""
    from dabba.models.identity import model_key

    return Path(resolved.config.cache_config.kv_offload_dir) / model_key(resolved)


def key_name(key: Hashable) -> str:
    """A block's file name: its chained hash (the key is (group 0, hash))."""
    return key[1].hex()


def name_key(name: str) -> Hashable:
    return (0, bytes.fromhex(name))


def list_blocks(directory: Path) -> list[Hashable]:
    """The blocks a disk tier directory holds, least recently used (by modification time) first;
    leftovers of interrupted writes are deleted."""
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        name = entry.name
        if ".tmp" in name:
            Path(entry.path).unlink(missing_ok=True)
            continue
        stem, dot, ext = name.partition(".")
        if ext == "kv" and len(stem) == 32 and all(c in "0123456789abcdef" for c in stem):
            found.append((entry.stat().st_mtime_ns, stem))
    return [name_key(stem) for _, stem in sorted(found)]


class DiskStore:
    """The disk tier's files for one model (``directory`` is its own, named by its model key):
    one thread writes, reads and deletes them, in the order asked."""

    def __init__(self, directory: Path, model_key: str) -> None:
        self.directory, self.model_key = directory, model_key
        directory.mkdir(parents=True, exist_ok=True)
        self._ops: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.pending_reads = 0  # asked for and not yet taken by completed() (the engine thread's count)
        threading.Thread(target=self._run, name="dabba-kv-disk", daemon=True).start()

    def path(self, key: Hashable) -> Path:
        return self.directory / f"{key_name(key)}.kv"

    def write(self, key: Hashable, tensors: list[torch.Tensor]) -> None:
        self._ops.put(("write", key, tensors))

    def read(self, key: Hashable, expected: list[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.pending_reads += 1
        self._ops.put(("read", key, expected))

    def delete(self, key: Hashable) -> None:
        self._ops.put(("delete", key, None))

    def completed(self, wait: float = 0.0) -> list[tuple[Hashable, list[torch.Tensor] | None]]:
        """Reads that ended: (key, its tensors, or None where the file failed). Waits up to
        ``wait`` seconds for the first one."""
        out = []
        try:
            out.append(self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.pending_reads -= len(out)
        return out

    def flush(self) -> None:
        """Wait until every operation asked so far is done (tests; shutdown)."""
        done = threading.Event()
        self._ops.put(("flush", None, done))
        done.wait(60)

    def _run(self) -> None:
        while True:
            op, key, arg = self._ops.get()
            try:
                if op == "write":
                    self._write(key, arg)
                elif op == "read":
                    self._done.put((key, self._read(key, arg)))
                elif op == "delete":
                    self.path(key).unlink(missing_ok=True)
                else:
                    arg.set()
            except Exception:  # a full disk, a lost directory: the block is recomputed, the engine goes on
                logger.exception("the KV disk tier's %s of %s failed", op, self.path(key) if key else "")
                if op == "read":
                    self._done.put((key, None))

    def _write(self, key: Hashable, tensors: list[torch.Tensor]) -> None:
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
        header = json.dumps({"version": FORMAT_VERSION, "model": self.model_key, "key": key_name(key),
                             "parts": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors],
                             "crc32": zlib.crc32(payload)}).encode()
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, path)

    def _read(self, key: Hashable, expected: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor] | None:
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        tensors = self._parse(data, key, expected)
        if tensors is None:
            logger.warning("the KV disk tier's file %s failed its checks: deleted, its block recomputed", path)
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used, for the next start's order
        return tensors

    def _parse(self, data: bytes, key: Hashable, expected: list[tuple[torch.dtype, tuple[int, ...]]]
               ) -> list[torch.Tensor] | None:
        """The block's tensors, or None for a file that is not exactly the one asked for."""
        start = len(MAGIC) + 4
        if len(data) < start or not data.startswith(MAGIC):
            return None
        (size,) = struct.unpack("<I", data[len(MAGIC):start])
        try:
            header = json.loads(data[start:start + size])
        except (ValueError, UnicodeDecodeError):
            return None
        want = [[str(dtype).removeprefix("torch."), list(shape)] for dtype, shape in expected]
        if not isinstance(header, dict) or (header.get("version"), header.get("model"), header.get("key"),
                                            header.get("parts")) != (FORMAT_VERSION, self.model_key,
                                                                     key_name(key), want):
            return None
        payload = data[start + size:]
        nbytes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in expected]
        if len(payload) != sum(nbytes) or zlib.crc32(payload) != header.get("crc32"):
            return None
        out, offset = [], 0
        for (dtype, shape), n in zip(expected, nbytes):
            out.append(torch.frombuffer(bytearray(payload[offset:offset + n]), dtype=torch.uint8).view(dtype).view(shape))
            offset += n
        return out
