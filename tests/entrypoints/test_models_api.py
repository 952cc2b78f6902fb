"""A server of several models over HTTP: the request's model routes it (loading the model on first
use), /v1/models lists every model with its state, operators load and unload behind the API key,
and the router's refusals take the API's error shape (404, 503 with Retry-After, 507)."""
from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from dabba.config import EngineConfig
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.model_router import ModelRouter, ModelSpec
from dabba.entrypoints.openai.api_server import build_router_app
from tests.conftest import hf_greedy
from tests.entrypoints.live_server import serving
from tests.test_lora import make_adapter

KEY = "sk-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
OPTIONS = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory=4 * 2**20)


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    """Two PEFT adapters of the tiny Llama and PEFT's greedy tokens for one prompt with each."""
    llama = checkpoints["llama"]
    paths, expected = {}, {}
    for i, name in enumerate(("sql", "poet")):
        paths[name] = tmp_path_factory.mktemp(name)
        expected[name] = hf_greedy(make_adapter(llama.path, paths[name], 20 + i, 8, 16, ["q_proj", "v_proj"], False),
                                   llama.prompts[2:3], 8)[0]
    return paths, expected


@pytest.fixture(scope="module")
def server(checkpoints, adapters):
    llama, qwen = checkpoints["llama"], checkpoints["qwen2"]
    gate = threading.Event()

    def build(config: EngineConfig) -> LLMEngine:
        if config.model_config.max_model_len == 96:  # the "slow" model's loads wait for the test
            gate.wait(60)
        return LLMEngine(config)

    specs = [ModelSpec("llama", EngineConfig.from_kwargs(model=str(llama.path), **OPTIONS)),
             ModelSpec("qwen", EngineConfig.from_kwargs(model=str(qwen.path), **OPTIONS)),
             ModelSpec("slow", EngineConfig.from_kwargs(model=str(llama.path), max_model_len=96, **OPTIONS)),
             ModelSpec("huge", EngineConfig.from_kwargs(model=str(llama.path), **{**OPTIONS,
                                                                                 "kv_cache_memory": 2**40})),
             ModelSpec("tuned", EngineConfig.from_kwargs(model=str(llama.path), enable_lora=True, max_loras=2,
                                                         **OPTIONS))]
    router = ModelRouter(specs, 2**30, max_waiting=1, build_engine=build)
    app = build_router_app(router, api_key=KEY, lora_modules={"tuned": {"sql": str(adapters[0]["sql"])}})
    loop = threading.Thread(target=router.run_loop, daemon=True)
    loop.start()
    with serving(app) as url:
        yield url, llama, qwen, gate
    router.shutdown()
    loop.join(timeout=30)


def complete(url: str, model: str | None, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            **extra})


def listed(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(f"{url}/v1/models", headers=HEADERS).json()["data"]}


def text_of(url: str, model: str, ids: list[int]) -> str:
    r = httpx.post(f"{url}/detokenize", headers=HEADERS, json={"model": model, "tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_requests_route_by_model_and_load_it(server):
    url, llama, qwen, _ = server
    assert listed(url)["qwen"] == "unloaded"
    r = complete(url, "qwen", qwen.prompts[2])
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "qwen"
    assert r.json()["choices"][0]["text"] == text_of(url, "qwen", qwen.reference[2][:8])
    r = complete(url, "llama", llama.prompts[2], keep_alive="10m")
    assert r.json()["choices"][0]["text"] == text_of(url, "llama", llama.reference[2][:8])
    assert {k: v for k, v in listed(url).items() if k in ("llama", "qwen")} == {"llama": "loaded", "qwen": "loaded"}
    chat = httpx.post(f"{url}/v1/messages", headers=HEADERS, timeout=60,
                      json={"model": "qwen", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "qwen"
    metrics = httpx.get(f"{url}/metrics").text
    assert 'dabba:generation_tokens_total{model_name="llama"}' in metrics
    assert 'dabba:generation_tokens_total{model_name="qwen"}' in metrics


def test_bad_model_names_and_keep_alive(server):
    url, llama, _, _ = server
    r = complete(url, "gpt-4", llama.prompts[1])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert str(llama.path) not in r.text and "llama" in r.json()["error"]["message"]
    r = complete(url, None, llama.prompts[1])
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = complete(url, "llama", llama.prompts[1], keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    r = complete(url, "huge", llama.prompts[1])
    assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_memory"
    assert "--models-memory" in r.json()["error"]["message"]


def test_operators_load_and_unload_behind_the_key(server):
    url, llama, _, _ = server
    assert httpx.post(f"{url}/models/unload", json={"model": "llama"}).status_code == 401
    r = httpx.post(f"{url}/models/unload", headers=HEADERS, json={"model": "llama"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"model": "llama", "state": "unloaded"}
    assert listed(url)["llama"] == "unloaded"
    assert httpx.get(f"{url}/engine/stats", headers=HEADERS, params={"model": "llama"}).status_code == 409
    assert httpx.get(f"{url}/engine/stats", headers=HEADERS, params={"model": "nope"}).status_code == 404
    r = httpx.post(f"{url}/models/load", headers=HEADERS, json={"model": "llama"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"model": "llama", "state": "loaded"}
    stats = httpx.get(f"{url}/engine/stats", headers=HEADERS, params={"model": "llama"})
    assert stats.status_code == 200 and stats.json()["step"] == 0  # a fresh engine's
    assert httpx.post(f"{url}/models/load", headers=HEADERS, json={"model": "nope"}).status_code == 404


def test_requests_past_the_waiting_bound_get_503_with_retry_after(server):
    url, llama, _, gate = server
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, url, "slow", llama.prompts[1])
        while listed(url)["slow"] != "loading":
            pass
        r = complete(url, "slow", llama.prompts[1])
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "model_unavailable"
        gate.set()
        assert first.result().status_code == 200


def test_adapters_route_to_their_base_model(server, adapters):
    url, llama, _, _ = server
    paths, expected = adapters
    assert listed(url)["tuned"] == "unloaded"
    r = complete(url, "sql", llama.prompts[2])  # an adapter from the start: loads its base
    assert r.status_code == 200 and r.json()["model"] == "sql", r.text
    assert r.json()["choices"][0]["text"] == text_of(url, "tuned", expected["sql"])
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=HEADERS).json()["data"]}
    assert (models["tuned"]["state"], models["sql"]["parent"], models["sql"]["state"]) == ("loaded", "tuned", "loaded")
    load = {"lora_name": "poet", "lora_path": str(paths["poet"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS, json=load)
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name"  # which model's?
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS, json={**load, "base_model_name": "tuned"})
    assert r.status_code == 200, r.text
    r = complete(url, "poet", llama.prompts[2])
    assert r.json()["choices"][0]["text"] == text_of(url, "tuned", expected["poet"])
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS, json={**load, "base_model_name": "nope"})
    assert r.status_code == 404
