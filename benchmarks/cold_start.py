"""A cold model's first token against what `dabba plan --load-time` predicts: the plan's load
time for the model (rates measured on this machine just before), then `dabba serve --model
NAME=DIR` (a server of several models, the model unloaded until asked), one request of
--input-len random tokens (its first token waits for the load and the prefill), then one more of
the same length on the loaded model (the prefill alone). Prints one JSON object:

    python -m benchmarks.peers.make_shapes --shapes llama-3.2-1b --no-gguf   # /tmp/shapes/llama-3.2-1b
    python -m benchmarks.cold_start --model /tmp/shapes/llama-3.2-1b [--kv-cache-memory 1GiB]

The bar: cold_ttft_s <= predicted_load_s + prefill_s ("within_prediction"). The plan reads a
sample of the checkpoint, so the load that follows may find part of it in the page cache.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time

import httpx

from benchmarks.vision_ttft import _cpu_name

DABBA = [sys.executable, "-m", "dabba.entrypoints.cli"]


def first_token_seconds(url: str, prompt: list[int], timeout: float) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": "cold", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def run(model: str, input_len: int, engine_args: list[str], timeout: float) -> dict:
    plan = subprocess.run(DABBA + ["plan", model, "--load-time", "--json", "--quantization", "none",
                                   "--kv-cache-dtype", "auto", *plan_args(engine_args)],
                          capture_output=True, text=True, check=True)
    predicted = json.loads(plan.stdout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(DABBA + ["serve", "--model", f"cold={model}", "--port", str(port), *engine_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.1)
        vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(2)]
        cold = first_token_seconds(url, prompts[0], timeout)
        warm = first_token_seconds(url, prompts[1], timeout)
        card = next(m for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] == "cold")
    finally:
        server.terminate()
        server.wait(timeout=60)
    row = predicted["rows"][0]
    return {"benchmark": "cold_start", "cpu": _cpu_name(), "model": model, "input_len": input_len,
            "predicted_load_s": round(row["load_seconds"], 2), "load_rates": predicted["load_rates"],
            "kv_cache_bytes": row["kv_cache_memory"], "server_load_s": round(card["load_seconds"], 2),
            "cold_ttft_s": round(cold, 2), "prefill_s": round(warm, 2),
            "within_prediction": cold <= row["load_seconds"] + warm}


def plan_args(engine_args: list[str]) -> list[str]:
    """The engine flags the plan takes too (the KV budget and dtype decide its figures)."""
    out, i = [], 0
    while i < len(engine_args):
        if engine_args[i] in ("--kv-cache-memory", "--dtype", "--max-model-len", "--block-size"):
            out += engine_args[i:i + 2]
        i += 2 if engine_args[i].startswith("--") and i + 1 < len(engine_args) else 1
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    engine_args = ["--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype]
    print(json.dumps(run(args.model, args.input_len, engine_args, args.timeout)))


if __name__ == "__main__":
    main()
