"""Phase 2, disconnect storm: clients hang up at random points; the server must settle and
give the same greedy outputs as before."""
from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import struct
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx

from .common import PhaseResult, Target, scrape_gauges, timed, wait_idle
from .soak import PROMPTS


# ---- phase 2: disconnect storm -----------------------------------------------------------------------

GREEDY = (
    ("completions", "The quick brown fox"),
    ("completions", PROMPTS[4]),  # several KV blocks long: its prefix is cached between the two runs
    ("chat", "What is JSON?"),
)
HANGUPS = ("before_first_byte", "after_first_chunk", "mid_stream", "non_stream")
GENERATED = "dabba:generation_tokens_total"


@dataclass(frozen=True)
class StormConfig:
    disconnects: int = 24
    workers: int = 8  # clients hanging up at once
    max_tokens: int = 384  # long enough that every hang-up finds its request running
    greedy_tokens: int = 24
    settle_timeout_s: float = 60.0  # bounds a leak only
    seed: int = 0


def greedy_outputs(target: Target, num_tokens: int) -> list[tuple[str, list[str]]]:
    """Text and tokens of each GREEDY prompt, one at a time on an idle server."""
    outputs = []
    with target.client() as client:
        for endpoint, prompt in GREEDY:
            body: dict[str, Any] = {"model": target.model, "max_tokens": num_tokens, "temperature": 0,
                                    "ignore_eos": True}
            if endpoint == "completions":
                r = client.post("/v1/completions", json={**body, "prompt": prompt, "logprobs": 0})
                r.raise_for_status()
                c = r.json()["choices"][0]
                outputs.append((c["text"], c["logprobs"]["tokens"]))
            else:
                r = client.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": prompt}], "logprobs": True})
                r.raise_for_status()
                c = r.json()["choices"][0]
                outputs.append((c["message"]["content"], [t["token"] for t in c["logprobs"]["content"]]))
    return outputs


def raw_http_request(target: Target, path: str, body: dict) -> bytes:
    """An HTTP/1.1 POST as bytes, for clients that hang up on a bare socket."""
    url = urllib.parse.urlsplit(target.url)
    payload = json.dumps(body).encode()
    headers = {"Host": url.netloc, "Content-Type": "application/json", "Content-Length": str(len(payload)),
               **target.auth()}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + payload


def hang_up_raw(target: Target, path: str, body: dict, rng: random.Random) -> None:
    """Send the request on a bare socket and close it without reading a byte: at once or after a
    random moment, with a FIN or (half the time) a RST."""
    url = urllib.parse.urlsplit(target.url)
    if url.scheme != "http":
        raise ValueError("the storm's bare-socket clients speak plain http only")
    with socket.create_connection((url.hostname, url.port or 80), timeout=target.timeout_s) as sock:
        sock.sendall(raw_http_request(target, path, body))
        pause = rng.choice((0.0, 0.0, 0.01, 0.05, 0.2))  # where it lands varies; no check depends on it
        if pause:
            time.sleep(pause)
        if rng.random() < 0.5:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def hang_up_streaming(target: Target, path: str, body: dict, num_events: int) -> str | None:
    """Read ``num_events`` data events of a stream, then close the connection."""
    with target.client() as client, client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return f"HTTP {r.status_code}: {r.text[:200]!r}"
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]" or "error" in json.loads(line[len("data: "):]):
                    return f"the stream ended after {seen} events, before the hang-up point {num_events}: {line[:120]}"
                seen += 1
                if seen >= num_events:
                    return None
    return f"the stream ended after {seen} events, before the hang-up point {num_events}"


def storm_body(target: Target, rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, dict]:
    n = min(rng.choice((1, 2)), target.limits.max_n)
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                            "stream": stream, "temperature": 1.0}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": rng.choice(PROMPTS)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}


def one_hang_up(target: Target, mode: str, seed: int, max_tokens: int) -> str | None:
    rng = random.Random(seed)
    path, body = storm_body(target, rng, stream=mode != "non_stream", max_tokens=max_tokens)
    if mode in ("before_first_byte", "non_stream"):
        hang_up_raw(target, path, body, rng)
        return None
    return hang_up_streaming(target, path, body, 1 if mode == "after_first_chunk" else rng.randint(2, 12))


@timed
def run_storm(target: Target, config: StormConfig = StormConfig()) -> PhaseResult:
    """Greedy outputs, then D clients hanging up at random points, then: the server settles (no
    request running or waiting, no KV block held) and the greedy outputs are the same."""
    result = PhaseResult("storm", {"disconnects": 0, "greedy_prompts": len(GREEDY)})
    problem = wait_idle(target, config.settle_timeout_s)
    if problem:
        result.failures.append(f"before the storm: {problem}")
    before = greedy_outputs(target, config.greedy_tokens)
    rng = random.Random(config.seed)
    plan = [(HANGUPS[i % len(HANGUPS)], rng.randrange(2**31)) for i in range(config.disconnects)]
    rng.shuffle(plan)
    with target.client() as client:
        generated = scrape_gauges(client).get(GENERATED, 0.0)

    def hang_up(item: tuple[str, int]) -> tuple[str, str | None]:
        mode, seed = item
        try:
            return mode, one_hang_up(target, mode, seed, config.max_tokens)
        except (OSError, ValueError, httpx.HTTPError) as e:
            return mode, f"{type(e).__name__}: {e}"

    with concurrent.futures.ThreadPoolExecutor(config.workers) as pool:
        for mode, problem in pool.map(hang_up, plan):
            if problem:
                result.failures.append(f"{mode}: {problem}")
            else:
                result.add("disconnects")
                result.add(mode)
    problem = wait_idle(target, config.settle_timeout_s)
    if problem:
        result.failures.append(f"after the storm: {problem}")
        return result
    with target.client() as client:  # reported: far fewer than max_tokens per sample, as requests were aborted
        result.counts["generated_tokens"] = int(scrape_gauges(client).get(GENERATED, 0.0) - generated)
    after = greedy_outputs(target, config.greedy_tokens)
    for (endpoint, prompt), b, a in zip(GREEDY, before, after):
        if a != b:
            result.failures.append(f"greedy {endpoint} {prompt[:30]!r} changed: {b[0]!r} -> {a[0]!r}")
        else:
            result.add("greedy_same")
    return result
