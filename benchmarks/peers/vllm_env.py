"""The environment vLLM's CPU build runs in, offline and serving, for compare_peers."""
from __future__ import annotations

from pathlib import Path

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # vLLM's CPU build wants it preloaded


def vllm_env(serve: bool = False) -> dict[str, str]:
    """2 threads on 2 cores. Offline runs give vLLM its KV budget in bytes through the spec; served,
    its CPU build refuses to start on this VM without an explicit KV space."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
    if serve:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if Path(TCMALLOC).is_file():
        env["LD_PRELOAD"] = TCMALLOC
    return env
