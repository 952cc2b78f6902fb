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


def test_serve_finishes_in_flight_requests_on_sigterm(checkpoints) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(DABBA + ["serve", str(checkpoints["llama"].path), "--port", str(port),
                                     "--dtype", "float32", "--kv-cache-memory", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []  # read as it comes, so a chatty server never blocks on a full pipe

    def read_log() -> None:
        for line in proc.stdout:
            log.append(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a bound on a hang only: the first start may build the kernels
        while True:
            assert proc.poll() is None, "".join(log)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

        body = {"prompt": "x", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
            data = [next(lines)]
            # its first chunk came, so it is in flight (the engine made a token; the rest is to come)
            proc.send_signal(signal.SIGTERM)
            data += list(lines)
        assert data[-1] == "[DONE]", data[-3:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 300  # finished, not cut off
        # uvicorn re-raises the signal once it has shut down, so the exit status reports it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        reader.join(timeout=60)
        text = "".join(log)
        assert "Shutting down" in text or "Finished server process" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
