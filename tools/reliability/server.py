"""`dabba serve` as a subprocess of the script (ServerProcess) and a free port for it."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from dabba.config import ServerConfig


REPO = Path(__file__).resolve().parents[2]

# ---- the script's server of its own ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`dabba serve` started by the script, its log in a file (a chatty server never blocks)."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    @classmethod
    def start(cls, model: str, limits: ServerConfig, api_key: str | None, extra: list[str],
              startup_timeout_s: float = 600.0) -> "ServerProcess":
        port = free_port()
        log_path = Path(tempfile.mkstemp(prefix="dabba-reliability-", suffix=".log")[1])
        command = [sys.executable, "-m", "dabba.entrypoints.cli", "serve", model, "--port", str(port),
                   *(["--api-key", api_key] if api_key else []), "--max-n", str(limits.max_n),
                   "--max-stop-sequences", str(limits.max_stop_sequences),
                   "--max-stop-length", str(limits.max_stop_length),
                   "--max-request-body-bytes", str(limits.max_request_body_bytes),
                   "--shutdown-timeout", str(limits.shutdown_timeout), *extra]
        with open(log_path, "w") as log:  # run from the repository, whose dabba this suite checks
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        server.wait_ready(startup_timeout_s)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health is 200; the first start may build the native kernels (minutes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not come up in {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def rss_kib(self) -> int | None:
        """VmRSS of the server process, from /proc (Linux)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then its exit status (0: a clean drain); killed if it outlasts ``timeout_s``."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -signal.SIGKILL

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def log_errors(self) -> list[str]:
        """Error lines of its log (it runs at --log-level warning): an unhandled exception, a
        traceback, an asyncio "exception was never retrieved" are bugs even when every client
        got the right answer."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if line.startswith("ERROR") or "Traceback (most recent call last)" in line
                or "never retrieved" in line]
