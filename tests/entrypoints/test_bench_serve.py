"""`dabba.tools.bench.serve` against the real server on a loopback port. No performance figure is asserted."""
from __future__ import annotations

import argparse
import asyncio
import json
import math

import numpy as np
import pytest

from dabba.tools.bench.serve import (ServeBenchConfig, add_serve_args, build_prompts,
                                   poisson_arrival_times, run_serve_benchmark, serve_config_from_args)
from dabba.tools.bench.serve_report import plot_serve

from tests.entrypoints.live_server import free_port, live_server

API_KEY = "sk-dabba-bench"
MODEL = "tiny"
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server(checkpoints):
    path = str(checkpoints["llama"].path)
    with live_server(path, MODEL, API_KEY) as (url, _):
        yield url, path


def config(server, **kw) -> ServeBenchConfig:
    url, path = server
    base = dict(base_url=url, model=MODEL, api_key=API_KEY, num_prompts=12, input_len=16, output_len=8,
                tokenizer=path, seed=3)
    return ServeBenchConfig(**{**base, **kw})


def check_result(result: dict, n: int, out_len: int) -> None:
    assert result["completed"] == n and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == n * out_len
    assert result["total_input_tokens"] == n * 16
    assert result["duration_s"] > 0 and result["request_throughput"] > 0 and result["output_throughput"] > 0
    for key in METRICS:
        s = result[key]
        assert all(s[k] is not None for k in ("mean", "median", "p50", "p90", "p99")), key
        assert s["p50"] <= s["p90"] <= s["p99"], key
    for k in ("p50", "p90", "p99"):
        assert 0 < result["ttft_ms"][k] <= result["e2e_ms"][k]
    json.dumps(result, allow_nan=False)


@pytest.mark.parametrize("rate", [50.0, math.inf])
def test_random_prompts_all_complete(server, rate, tmp_path) -> None:
    cfg = config(server, request_rate=rate, save_requests=True, slo_ttft_ms=1e9, slo_tpot_ms=1e9, slo_e2e_ms=1e9)
    result = asyncio.run(run_serve_benchmark(cfg))
    check_result(result, 12, 8)
    assert result["good_requests"] == 12
    assert result["goodput"] == pytest.approx(result["completed"] / result["duration_s"])
    reqs = result["requests"]
    assert len(reqs) == 12 and all(r["success"] and r["output_tokens"] == 8 for r in reqs)
    assert all(r["arrival_s"] <= r["send_s"] <= r["first_token_s"] <= r["end_s"] for r in reqs)
    assert [r["arrival_s"] for r in reqs] == pytest.approx(poisson_arrival_times(12, rate, 3))
    plot_serve(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_impossible_slo_and_concurrency_cap(server) -> None:
    result = asyncio.run(run_serve_benchmark(config(server, model=None, max_concurrency=3, slo_ttft_ms=1e-6)))
    check_result(result, 12, 8)
    assert result["config"]["model"] == MODEL  # found through GET /v1/models
    assert result["good_requests"] == 0 and result["goodput"] == 0
    assert "requests" not in result and "api_key" not in result["config"]


def test_file_dataset(server, tmp_path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(20)))
    cfg = config(server, dataset="file", dataset_path=str(text), num_prompts=5, input_len=10, output_len=4)
    prompts = build_prompts(cfg)
    assert len(prompts) == 5 and all(isinstance(p, str) and len(p) == 40 for p in prompts)
    assert len(build_prompts(config(server, dataset="file", dataset_path=str(text), num_prompts=200))) == 200
    result = asyncio.run(run_serve_benchmark(cfg))
    assert result["completed"] == 5 and result["failed"] == 0 and result["total_output_tokens"] == 20
    assert result["total_input_tokens"] > 0  # from the usage chunk


def test_wrong_url_fails_every_request_without_raising() -> None:
    cfg = ServeBenchConfig(base_url=f"http://127.0.0.1:{free_port()}", num_prompts=4, input_len=4, output_len=2,
                           slo_e2e_ms=1e9)
    result = asyncio.run(run_serve_benchmark(cfg))
    assert result["completed"] == 0 and result["failed"] == 4
    assert result["errors"] and sum(result["errors"].values()) == 4 and all(result["errors"])
    assert result["goodput"] == 0 and result["ttft_ms"]["mean"] is None
    json.dumps(result, allow_nan=False)


def test_wrong_api_key_is_reported(server) -> None:
    result = asyncio.run(run_serve_benchmark(config(server, num_prompts=2, api_key="wrong")))
    assert result["failed"] == 2 and any("401" in m for m in result["errors"])


def test_poisson_schedule() -> None:
    a = poisson_arrival_times(10000, 20.0, seed=7)
    assert a == poisson_arrival_times(10000, 20.0, seed=7)
    assert a != poisson_arrival_times(10000, 20.0, seed=8)
    gaps = np.diff(a)
    assert a[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert poisson_arrival_times(5, math.inf) == [0.0] * 5


def test_random_ids_avoid_specials_and_default_vocab() -> None:
    prompts = build_prompts(ServeBenchConfig(num_prompts=50, input_len=64, seed=1))
    flat = np.array(prompts)
    assert flat.shape == (50, 64) and flat.min() >= 3 and flat.max() < 4096
    assert prompts == build_prompts(ServeBenchConfig(num_prompts=50, input_len=64, seed=1))
    small = np.array(build_prompts(ServeBenchConfig(num_prompts=4, input_len=200, vocab_size=10)))
    assert small.min() >= 3 and small.max() < 10


def test_cli_args_map_to_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--base-url", "http://h:1", "--model", "m", "--num-prompts", "7", "--dataset", "file",
                              "--dataset-path", "x.txt", "--input-len", "5", "--output-len", "6",
                              "--request-rate", "2.5", "--max-concurrency", "3", "--slo-ttft-ms", "100",
                              "--slo-tpot-ms", "20", "--slo-e2e-ms", "900", "--seed", "9", "--json-out", "o.json",
                              "--chart", "c.png", "--api-key", "k", "--vocab-size", "100", "--tokenizer", "t"])
    cfg = serve_config_from_args(args)
    assert cfg == ServeBenchConfig(base_url="http://h:1", model="m", api_key="k", num_prompts=7, dataset="file",
                                   dataset_path="x.txt", input_len=5, output_len=6, vocab_size=100, tokenizer="t",
                                   request_rate=2.5, max_concurrency=3, slo_ttft_ms=100, slo_tpot_ms=20,
                                   slo_e2e_ms=900, seed=9)
    assert args.json_out == "o.json" and args.chart == "c.png"
    assert math.isinf(serve_config_from_args(parser.parse_args([])).request_rate)
