"""The reliability suite (tools/reliability/) in small: each phase against one in-process
server of a tiny checkpoint, asserting it found nothing wrong and did what it was asked (so no
phase passes by doing nothing), and the script end to end, starting and stopping its own server."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dabba.config import ServerConfig
from tools.reliability.common import Target, error_shape_problem, server_limits
from tools.reliability.constraints import hostile_cases
from tools.reliability.fuzz import FuzzConfig, run_fuzz
from tools.reliability.malformed import malformed_table, raw_table, run_malformed
from tools.reliability.soak import SoakConfig, run_soak
from tools.reliability.storm import GREEDY, HANGUPS, StormConfig, run_storm

from tests.entrypoints.live_server import live_server

API_KEY = "sk-reliability"
MODEL = "tiny"
LIMITS = ServerConfig(max_n=8, max_stop_sequences=4, max_stop_length=64, max_request_body_bytes=256 * 1024)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(checkpoints):
    """(the server as the suite sees it, its engine)."""
    with live_server(str(checkpoints["llama"].path), MODEL, API_KEY, config=LIMITS) as (url, engine):
        yield Target(url=url, model=MODEL, api_key=API_KEY, limits=LIMITS), engine


@pytest.fixture
def target(server) -> Target:
    return server[0]


@pytest.fixture(autouse=True)
def no_errors_logged():
    """The in-process server logs nothing at ERROR (an unhandled exception, a failed stream, an
    asyncio "exception was never retrieved") while a phase runs, even if every answer was right."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("asyncio", "uvicorn.error", "dabba")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_soak(target) -> None:
    result = run_soak(target, SoakConfig(clients=4, requests_per_client=6, seed=1))
    assert result.failures == []
    assert result.server_errors == 0
    assert result.counts["requests"] == result.counts["checked"] == 24
    assert result.counts["streamed"] > 0 and result.counts["single"] > 0
    assert result.counts["with_stop"] > 0 and result.counts["ignore_eos_exact"] > 0
    assert result.counts["tokens"] > 0


def test_disconnect_storm(target) -> None:
    result = run_storm(target, StormConfig(disconnects=24, seed=2))
    assert result.failures == []
    assert result.counts["disconnects"] == 24
    assert all(result.counts[mode] == 24 // len(HANGUPS) for mode in HANGUPS)
    assert result.counts["greedy_same"] == len(GREEDY)


def test_fuzz(target) -> None:
    config = FuzzConfig(cases=620, seed=3)  # at least 20 cases for each of 10 POST operations, in both modes
    result = run_fuzz(target, config)
    assert result.failures == []
    assert result.server_errors == 0
    posts = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/responses", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/embeddings", "/v1/score", "/v1/rerank"]
    for path in posts:  # every POST operation fuzzed in both modes
        for mode in ("positive", "negative"):
            assert result.breakdown.get(f"POST {path} {mode}", {}).get("cases", 0) >= 20, result.breakdown
    assert result.counts["cases"] >= 0.8 * config.cases, result.counts
    assert result.counts.get("2xx", 0) > 0 and result.counts.get("4xx", 0) > 0
    # the constraint cases: every random valid one served, every hostile one refused as it must be
    assert result.counts["constraint_cases"] == config.constraint_cases + len(hostile_cases(target.limits))
    assert result.breakdown["constraints"].get("200", 0) >= config.constraint_cases


def test_the_suite_reads_the_bounds_of_the_server_it_probes(target) -> None:
    assert server_limits(target.url, target.api_key) == LIMITS


def test_malformed_table(target) -> None:
    result = run_malformed(target)
    assert result.failures == []
    assert result.counts["passed"] == result.counts["rows"] == len(malformed_table(target)) + len(raw_table(target))


def test_an_unexpected_exception_is_a_500_in_openai_shape(server, monkeypatch, no_errors_logged) -> None:
    """A bug anywhere in a handler: JSON in OpenAI's shape, no internals (it was Starlette's
    plain-text "Internal Server Error"); the traceback goes to the log."""
    target, engine = server

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.model_info.tokenizer, "encode", broken)
    with target.client() as client:
        r = client.post("/tokenize", json={"prompt": "x"})
    assert r.status_code == 500 and error_shape_problem(r) is None, r.text
    assert r.json()["error"]["type"] == "server_error" and "injected" not in r.text
    deadline = time.monotonic() + 30  # uvicorn logs it once the response went out; this bounds a hang only
    while not no_errors_logged and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [record.getMessage().strip() for record in no_errors_logged] == ["Exception in ASGI application"]
    no_errors_logged.clear()


def test_the_script_end_to_end(checkpoints, tmp_path) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "tools.reliability", "--model", str(checkpoints["llama"].path), "--minutes", "0",
               "--clients", "2", "--requests-per-client", "2", "--disconnects", "4", "--fuzz-cases", "24",
               "--seed", "4", "--json-out", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=900)  # a bound on a hang only: a first start may build the kernels
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report == json.loads(proc.stdout)
    assert report["ok"] is True and report["server_exit"] == 0 and report["rounds"] == 1
    assert [p["phase"] for p in report["phases"]] == ["soak", "storm", "fuzz", "malformed"]
    assert report["totals"]["requests"] == 4 and report["totals"]["disconnects"] == 4
    assert report["totals"]["fuzz_cases"] > 0 and report["totals"]["server_errors_5xx"] == 0
    assert report["totals"]["failures"] == 0 and report["server_log_errors"] == []
    assert report["phases"][-1]["passed"] == report["phases"][-1]["rows"] == report["totals"]["malformed_rows"] > 0
    assert report["rss_kib"]["start"] > 0 and report["rss_kib"]["end"] > 0
    assert len(report["rss_kib"]["after_each_round"]) == 1
