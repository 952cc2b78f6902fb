"""How long `dabba serve` takes to be ready: from starting the process to GET /health answering
200, the demo model by default. Prints JSON.

    python -m benchmarks.startup [MODEL] [--runs 3] [--cold]

Each run is a fresh server process on a free port. ``--cold`` points TORCH_EXTENSIONS_DIR at an
empty directory for the first run, so an editable install pays its first compilation of the
kernels there (an installed wheel has nothing to compile: its first run is then the cold one);
the later runs find what the first left. The figures include Python's start and imports, the
kernels' load, the model's and the tokenizer's, and the KV cache's allocation.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(model: str | None, env: dict[str, str], timeout: float) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "dabba.entrypoints.cli", "serve", *([model] if model else []), "--port", str(port),
           "--log-level", "warning"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"dabba serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"not ready within {timeout} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled demo model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="the first run with an empty kernel cache")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    cache = tempfile.TemporaryDirectory() if args.cold else None
    if cache:
        env["TORCH_EXTENSIONS_DIR"] = cache.name
    try:
        seconds = [time_to_ready(args.model, env, args.timeout) for _ in range(args.runs)]
    finally:
        if cache:
            cache.cleanup()
    print(json.dumps({"benchmark": "startup", "model": args.model or "demo", "cold_kernel_cache": args.cold,
                      "ready_s": [round(s, 2) for s in seconds], "first_s": round(seconds[0], 2),
                      "warm_best_s": round(min(seconds[1:] or seconds), 2)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
