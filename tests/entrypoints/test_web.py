"""The browser pages' server side: the static pages, the engine snapshots and their event stream,
and the usage figures the playground shows (tests/entrypoints/test_web_browser.py drives the
pages in a real browser)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from dabba.core.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_SHARED, BLOCK_USED
from tests.entrypoints.live_server import live_server

API_KEY = "sk-web"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(checkpoints):
    with live_server(str(checkpoints["llama"].path), "tiny", API_KEY) as (url, engine):
        yield SimpleNamespace(url=url, engine=engine)


def test_the_pages_are_served_from_the_package_without_a_key(server) -> None:
    for path, script in (("/", "/static/playground.js"), ("/dashboard", "/static/dashboard.js")):
        page = httpx.get(server.url + path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert f'src="{script}"' in page.text and "http://" not in page.text and "https://" not in page.text
        asset = httpx.get(server.url + script)
        assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
    assert httpx.get(server.url + "/static/style.css").status_code == 200
    assert httpx.get(server.url + "/static/missing.js").status_code == 404


def test_snapshots_need_the_key_and_describe_the_engine(server) -> None:
    denied = httpx.get(f"{server.url}/engine/stats")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/engine/stats/stream").status_code == 401
    snapshot = httpx.get(f"{server.url}/engine/stats", headers=AUTH).json()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0 and snapshot["step_tokens"] == 0
    kv = snapshot["kv"]
    assert len(kv["grid"]) == kv["blocks"] == server.engine.engine_core.kv_cache_manager.num_usable_blocks
    assert set(kv["grid"]) <= {BLOCK_FREE, BLOCK_CACHED, BLOCK_USED, BLOCK_SHARED}
    assert kv["free"] + kv["cached"] + kv["used"] + kv["shared"] == kv["blocks"] and kv["used"] == 0


def test_the_stream_follows_a_request_and_ends_idle(server) -> None:
    """The first event is the engine now; while a request runs, snapshots show it; the last one
    after it shows the engine idle, its prompt's blocks left as cached prefix."""
    before = httpx.get(f"{server.url}/engine/stats", headers=AUTH).json()
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16 tokens, cached when the request ends
    events = []
    with httpx.Client(timeout=60) as client, client.stream("GET", f"{server.url}/engine/stats/stream",
                                                           headers=AUTH) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                break
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 30, "ignore_eos": True})
        assert r.status_code == 200
        for line in lines:  # the request has ended: the stream catches up, and ends on an idle snapshot
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["generated_tokens"] >= before["generated_tokens"] + 30 and events[-1]["running"] == 0:
                    break
    first, last = events[0], events[-1]
    assert first["running"] == 0 and first["generated_tokens"] == before["generated_tokens"]
    assert last["prompt_tokens"] == before["prompt_tokens"] + 40 and last["step"] > first["step"]
    assert last["step_tokens"] == 0 and last["kv"]["used"] == 0 and last["kv"]["cached"] >= 2
    assert [e["step"] for e in events] == sorted(set(e["step"] for e in events))  # one per step at most


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(server, stream) -> None:
    messages = [{"role": "user", "content": f"{stream}: a question long enough to fill a block or two of the cache."}]
    usages = []
    for _ in range(2):
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, json=body, timeout=60) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            usages.append(chunks[-1]["usage"])
        else:
            usages.append(httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=body, timeout=60)
                          .json()["usage"])
    first, second = (u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    block = server.engine.engine_core.kv_cache_manager.block_size
    assert first == 0 and second == usages[1]["prompt_tokens"] // block * block - (
        block if usages[1]["prompt_tokens"] % block == 0 else 0)
