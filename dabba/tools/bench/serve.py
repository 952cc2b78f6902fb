"""Online serving benchmark: drive any OpenAI-compatible server (dabba's or `vllm serve`) with
streamed `/v1/completions` requests on a Poisson arrival schedule and report TTFT, TPOT, ITL,
end-to-end latency, throughput and goodput, in the spirit of `vllm bench serve`.

Only the HTTP API is used, so the same client measures both servers with the same requests.

Datasets:
  random  prompts of ``input_len`` random token ids in ``[3, vocab_size)`` (ids 0-2 are usually the
          specials), from a seeded RNG. The vocabulary size is ``vocab_size`` if given, else the
          size of ``tokenizer``'s tokenizer.json (a directory or the file itself), else 4096.
  file    text prompts cut from a text file: its lines are joined and prompt ``i`` is the ``i``-th
          consecutive chunk of ``4 * input_len`` characters (about ``input_len`` tokens at ~4
          characters a token), wrapping around at the end of the file.

Every request asks for ``output_len`` tokens with ``ignore_eos`` and temperature 0, so the amount
of work does not depend on the model's outputs.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dabba.tools.bench.offline import FIRST_TOKEN_ID, OfflineWorkload, make_prompts

DEFAULT_VOCAB_SIZE = 4096
CHARS_PER_TOKEN = 4


@dataclass
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id from GET {base_url}/v1/models
    endpoint: str = "completions"
    api_key: str | None = None
    num_prompts: int = 100
    dataset: str = "random"  # "random" | "file"
    dataset_path: str | None = None
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 0  # random dataset: shared tokens before each prompt's own input_len
    num_prefixes: int = 1  # random dataset: prompt i shares prefix i % num_prefixes
    vocab_size: int | None = None
    tokenizer: str | None = None  # directory with tokenizer.json, or the file; used for vocab_size
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    seed: int = 0
    save_requests: bool = False
    timeout_s: float = 3600.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("api_key")  # never written to result files
        if math.isinf(d["request_rate"]):
            d["request_rate"] = "inf"  # JSON has no infinity
        return d


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    arrival_s: float = 0.0  # scheduled arrival, seconds after the benchmark start
    send_s: float = 0.0  # when it was sent (later than arrival when max_concurrency holds it back)
    first_token_s: float | None = None
    end_s: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    success: bool = False
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# Workload


def poisson_arrival_times(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds: the first at 0, then exponential gaps of mean 1/request_rate
    from a seeded RNG (a Poisson process). An infinite rate sends everything at 0."""
    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def resolve_vocab_size(cfg: ServeBenchConfig) -> int:
    if cfg.vocab_size:
        return int(cfg.vocab_size)
    if cfg.tokenizer:
        from tokenizers import Tokenizer

        path = Path(cfg.tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        return Tokenizer.from_file(str(path)).get_vocab_size()
    return DEFAULT_VOCAB_SIZE


def build_prompts(cfg: ServeBenchConfig) -> list[list[int] | str]:
    """``num_prompts`` prompts: lists of token ids (random) or strings (file)."""
    if cfg.dataset == "random":
        vocab = resolve_vocab_size(cfg)
        if vocab <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab}")
        # the offline benchmarks' generator: the same seed sends the same prompts online and offline
        return make_prompts(OfflineWorkload(cfg.num_prompts, cfg.input_len, cfg.output_len, seed=cfg.seed,
                                            prefix_len=cfg.prefix_len, num_prefixes=cfg.num_prefixes), vocab)
    if cfg.dataset == "file":
        if not cfg.dataset_path:
            raise ValueError("dataset 'file' needs dataset_path")
        lines = [ln.strip() for ln in Path(cfg.dataset_path).read_text(encoding="utf-8").splitlines()]
        text = " ".join(ln for ln in lines if ln)
        if not text:
            raise ValueError(f"{cfg.dataset_path} has no text")
        size = max(1, cfg.input_len * CHARS_PER_TOKEN)
        prompts = []
        for i in range(cfg.num_prompts):
            start = (i * size) % len(text)
            chunk = text[start:start + size]
            while len(chunk) < size and len(text) > 1:  # wrap around the end of the file
                chunk += " " + text[: size - len(chunk) - 1]
            prompts.append(chunk[:size])
        return prompts
    raise ValueError(f"unknown dataset {cfg.dataset!r} (expected 'random' or 'file')")


# ---------------------------------------------------------------------------------------------
# Requests


def _headers(cfg: ServeBenchConfig) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


async def _discover_model(client, cfg: ServeBenchConfig) -> str | None:
    try:
        r = await client.get(f"{cfg.base_url.rstrip('/')}/v1/models", headers=_headers(cfg), timeout=10)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # the requests themselves will report what is wrong
        return None


async def _send(client, cfg: ServeBenchConfig, model: str | None, prompt, rec: RequestRecord, t0: float) -> None:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    url = f"{cfg.base_url.rstrip('/')}/v1/completions"
    start = time.perf_counter()
    rec.send_s = start - t0
    first = last = None  # times of the first and latest chunk with text
    first_choice = None  # fallback when no chunk carries text
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=_headers(cfg)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:500]}")
            done = False
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if obj.get("error"):
                    err = obj["error"]
                    raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    if first_choice is None:
                        first_choice = now
                    if choice.get("text"):
                        chunks += 1
                        if first is None:
                            first = now
                        else:
                            rec.itl_ms.append((now - last) * 1000)
                        last = now
            if not done:
                raise RuntimeError("stream ended without data: [DONE]")
        end = time.perf_counter()
        rec.end_s = end - t0
        rec.e2e_ms = (end - start) * 1000
        first = first if first is not None else first_choice if first_choice is not None else end
        rec.first_token_s = first - t0
        rec.ttft_ms = (first - start) * 1000
        if usage and usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
        else:
            rec.output_tokens = chunks
        if usage and usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.tpot_ms = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1) if rec.output_tokens > 1 else None
        rec.success = True
    except Exception as e:  # noqa: BLE001 - any failure is this request's result, not the run's
        rec.end_s = time.perf_counter() - t0
        rec.success = False
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------------------------------------
# Metrics


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "median": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {"mean": float(a.mean()), "std": float(a.std()), "median": p50, "p50": p50, "p90": p90, "p99": p99}


def meets_slos(rec: RequestRecord, cfg: ServeBenchConfig) -> bool:
    """A successful request meets every SLO that is set (a one-token request has TPOT 0)."""
    if not rec.success:
        return False
    if cfg.slo_ttft_ms is not None and (rec.ttft_ms is None or rec.ttft_ms > cfg.slo_ttft_ms):
        return False
    if cfg.slo_tpot_ms is not None and (rec.tpot_ms or 0.0) > cfg.slo_tpot_ms:
        return False
    if cfg.slo_e2e_ms is not None and (rec.e2e_ms is None or rec.e2e_ms > cfg.slo_e2e_ms):
        return False
    return True


def summarize(cfg: ServeBenchConfig, records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    duration = max(duration_s, 1e-9)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    result: dict[str, Any] = {
        "config": cfg.to_dict(),
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,  # message -> count
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": _stats([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl_ms]),
        "e2e_ms": _stats([r.e2e_ms for r in ok if r.e2e_ms is not None]),
    }
    if any(s is not None for s in (cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_e2e_ms)):
        good = sum(meets_slos(r, cfg) for r in records)
        result["good_requests"] = good
        result["goodput"] = good / duration
    if cfg.save_requests:
        result["requests"] = [dataclasses.asdict(r) for r in records]
    return result


async def run_serve_benchmark(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Send ``cfg.num_prompts`` streamed completions on a Poisson schedule and return the metrics.

    Request failures (connection refused, HTTP errors, errors inside the stream) are counted in
    ``failed`` with their messages under ``errors``; they never raise."""
    import httpx

    if cfg.endpoint != "completions":
        raise ValueError(f"unsupported endpoint {cfg.endpoint!r} (only 'completions')")
    prompts = build_prompts(cfg)
    arrivals = poisson_arrival_times(len(prompts), cfg.request_rate, cfg.seed)
    records = [RequestRecord(i, len(p) if isinstance(p, list) else 0) for i, p in enumerate(prompts)]
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    # No connection cap (httpx's default 100 would queue requests inside the client and count the
    # wait as TTFT); trust_env=False so a proxy from the environment is not measured too.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits, trust_env=False) as client:
        model = cfg.model or await _discover_model(client, cfg)

        async def one(i: int) -> None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            records[i].arrival_s = arrivals[i]
            if sem is None:
                await _send(client, cfg, model, prompts[i], records[i], t0)
            else:
                async with sem:
                    await _send(client, cfg, model, prompts[i], records[i], t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
    result = summarize(cfg, records, duration)
    if cfg.model is None:
        result["config"]["model"] = model
    return result


# ---------------------------------------------------------------------------------------------
# CLI wiring (used by `dabba bench serve`)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, e.g. http://127.0.0.1:8000 (requests go to {base-url}/v1/completions)")
    parser.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--dataset", choices=["random", "file"], default="random")
    parser.add_argument("--dataset-path", default=None, help="text file for --dataset file")
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens (random) or ~tokens at 4 characters each (file)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request (ignore_eos)")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="random: shared prefix tokens before each prompt's own --input-len")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="random: distinct shared prefixes; prompt i takes prefix i mod this")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="random ids are drawn from [3, vocab-size); default: --tokenizer's size, else "
                             f"{DEFAULT_VOCAB_SIZE}")
    parser.add_argument("--tokenizer", default=None,
                        help="directory with tokenizer.json (or the file), for the vocab size")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on time per output token")
    parser.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on end-to-end latency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-requests", action="store_true", help="keep per-request records in the JSON")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--chart", default=None, metavar="FILE", help="write a PNG chart")


def serve_config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, num_prompts=args.num_prompts,
        dataset=args.dataset, dataset_path=args.dataset_path, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
        vocab_size=args.vocab_size, tokenizer=args.tokenizer, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        slo_e2e_ms=args.slo_e2e_ms, seed=args.seed,
        save_requests=bool(getattr(args, "save_requests", False)),
    )
