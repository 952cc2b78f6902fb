"""The command line as a user runs it: `dabba chat` in a terminal session, `dabba serve` stopped
by a signal while a request is in flight."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

DABBA = [sys.executable, "-m", "dabba.entrypoints.cli"]


def test_chat_streams_replies_and_keeps_the_conversation(checkpoints) -> None:
    path = str(checkpoints["llama"].path)
    proc = subprocess.run(DABBA + ["chat", path, "--temperature", "0", "--max-tokens", "6", "--dtype", "float32",
                                   "--kv-cache-memory", "16MiB"],
                          input="Hello\nWhat is JSON?\n\n", capture_output=True, text=True,
                          timeout=600)  # a bound on a hang only: the first start may build the kernels
    assert proc.returncode == 0, proc.stderr
    turns = [line for line in proc.stdout.split("you> ") if line.startswith("assistant> ")]
    assert len(turns) == 2, proc.stdout
    # the first reply is the greedy continuation of the chat-templated first message
    from dabba import LLM, SamplingParams

    llm = LLM(path, dtype="float32", kv_cache_memory=16 * 2**20)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    ref = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                       SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert turns[0] == f"assistant> {ref}\n"


class ServeProcess:
    """`dabba serve` (or a script that ends in it) on a free port, its log read as it comes (a chatty
    server never blocks on a full pipe); ready once /health answers."""

    def __init__(self, command: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(command + ["--port", str(port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 600  # a bound on a hang only: the first start may build the kernels
        while True:
            assert self.proc.poll() is None, self.text()
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

    def text(self) -> str:
        return "".join(self.log)

    def stream_then(self, body: dict, after_first_chunk) -> list[str]:
        """The data lines of a streamed completion; ``after_first_chunk()`` runs once it is in flight."""
        with httpx.stream("POST", f"{self.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
            data = [next(lines)]
            after_first_chunk()
            return data + list(lines)

    def wait(self) -> int:
        code = self.proc.wait(timeout=60)
        self.reader.join(timeout=60)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def serve_args(checkpoints, *extra: str) -> list[str]:
    return ["serve", str(checkpoints["llama"].path), "--dtype", "float32", "--kv-cache-memory", "16MiB", *extra]


def test_serve_finishes_in_flight_requests_on_sigterm(checkpoints) -> None:
    server = ServeProcess(DABBA + serve_args(checkpoints))
    try:
        body = {"prompt": "x", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        data = server.stream_then(body, lambda: server.proc.send_signal(signal.SIGTERM))
        assert data[-1] == "[DONE]", data[-3:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 300  # finished, not cut off
        assert server.wait() == 0, server.text()  # a clean drain
        assert "Draining" in server.text()
    finally:
        server.kill()


def test_a_drain_that_times_out_ends_the_stream_with_an_error_and_exits_3(checkpoints) -> None:
    server = ServeProcess(DABBA + serve_args(checkpoints, "--shutdown-timeout", "0"))
    try:
        body = {"prompt": "x", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        data = server.stream_then(body, lambda: server.proc.send_signal(signal.SIGTERM))
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "did not finish in time" in error["message"]
        assert server.wait() == 3, server.text()
    finally:
        server.kill()


# `dabba serve` whose engine step raises once a request has 5 output tokens
FAILING_SERVE = """
import sys
from dabba.engine.llm_engine import LLMEngine
from dabba.entrypoints.cli import main
real_step = LLMEngine.step_with_stats
def failing_step(self):
    outputs, stats = real_step(self)
    if any(s.num_output_tokens >= 5 for s in stats.requests.values()):
        raise RuntimeError("injected failure")
    return outputs, stats
LLMEngine.step_with_stats = failing_step
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_failure_fails_the_stream_and_exits_non_zero(checkpoints) -> None:
    server = ServeProcess([sys.executable, "-c", FAILING_SERVE] + serve_args(checkpoints))
    try:
        data = server.stream_then({"prompt": "x", "max_tokens": 50, "ignore_eos": True}, lambda: None)
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "engine failed" in error["message"]
        assert server.wait() == 1, server.text()
        assert "injected failure" in server.text()  # the log has the cause; the client does not
    finally:
        server.kill()


def models_args(checkpoints, *extra: str) -> list[str]:
    return ["serve", "--model", f"a={checkpoints['llama'].path}", "--model", f"b={checkpoints['qwen2'].path}",
            "--dtype", "float32", "--kv-cache-memory", "16MiB", *extra]


def test_serve_of_several_models_routes_then_drains_on_sigterm(checkpoints) -> None:
    server = ServeProcess(DABBA + models_args(checkpoints))
    try:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["state"]) for m in models] == [("a", "unloaded"), ("b", "unloaded")]
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "b", "prompt": "x", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "b"
        body = {"model": "a", "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        data = server.stream_then(body, lambda: server.proc.send_signal(signal.SIGTERM))
        assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["completion_tokens"] == 200
        assert server.wait() == 0, server.text()
    finally:
        server.kill()


def test_a_failed_model_fails_its_requests_and_the_others_serve_on(checkpoints) -> None:
    server = ServeProcess([sys.executable, "-c", FAILING_SERVE] + models_args(checkpoints))
    try:
        data = server.stream_then({"model": "a", "prompt": "x", "max_tokens": 50, "ignore_eos": True}, lambda: None)
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and "engine failed" in error["message"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "b", "prompt": "x", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/health").status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.text()
    finally:
        server.kill()
