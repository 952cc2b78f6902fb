"""The peak memory of a process tree, as compare_peers meters every engine: the proportional set
size (PSS) of a process and all its descendants, summed, sampled on a thread.

PSS rather than RSS: an engine that forks workers (vLLM's engine core) shares pages between them,
and PSS charges each shared page once in all, so the sum over the tree is what the engine costs the
machine. Linux only (/proc/<pid>/smaps_rollup, kernel 4.14+); stdlib only.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

MIB = 2**20
# A sample walks each process's page tables (smaps_rollup: about 8 ms of CPU for a 0.5 GB process)
# and scans /proc: the sampler waits long enough between samples to stay under this share of a core.
MAX_DUTY = 0.05


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def children_map() -> dict[int, list[int]]:
    """{parent pid: child pids} of every process now alive."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # after "(comm)": state, then ppid
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants now alive."""
    kids, tree, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += kids.get(pid, [])
    return tree


def tree_pss_bytes(root: int) -> int:
    return sum(pss_bytes(pid) for pid in process_tree(root))


@dataclass
class PssSampler:
    """The peak PSS of ``pid``'s process tree, sampled on a thread while the ``with`` block runs,
    every ``interval`` seconds or, where a sample costs more than MAX_DUTY of that, less often: the
    benchmark it meters shares the cores."""
    pid: int
    interval: float = 0.5
    peak: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def sample(self) -> None:
        self.peak = max(self.peak, tree_pss_bytes(self.pid))
        self.samples += 1

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            self.sample()
            if self._stop.wait(max(self.interval, (time.perf_counter() - start) / MAX_DUTY)):
                return

    def __enter__(self) -> PssSampler:
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def peak_mib(self) -> float:
        return self.peak / MIB
