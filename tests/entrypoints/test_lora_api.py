"""LoRA adapters over HTTP (vLLM's spelling): --lora-modules at start, the request's model field
naming an adapter, /v1/models listing them, /v1/load_lora_adapter and /v1/unload_lora_adapter at
run time behind the API key; the adapters' greedy replies equal PEFT's."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import Checkpoint, hf_greedy
from tests.entrypoints.live_server import live_server
from tests.test_lora import make_adapter

KEY = "sk-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    llama: Checkpoint = checkpoints["llama"]
    paths, expected = {}, {}
    for i, (name, targets) in enumerate((("sql", ["q_proj", "v_proj"]), ("poet", ["gate_proj", "down_proj"]))):
        paths[name] = tmp_path_factory.mktemp(name)
        peft_model = make_adapter(llama.path, paths[name], 10 + i, 8, 16, targets, False)
        expected[name] = hf_greedy(peft_model, llama.prompts[2:3], 8)[0]
    with live_server(str(llama.path), "base", KEY, lora_modules={"sql": str(paths["sql"])}, enable_lora=True,
                     max_loras=2) as (url, _):
        yield url, llama, paths, expected


def complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def detokenize(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", headers=HEADERS, json={"tokens": ids}).json()["prompt"]


def test_adapters_by_name_load_and_unload(setup) -> None:
    url, llama, paths, expected = setup
    prompt = llama.prompts[2]
    r = complete(url, "sql", prompt)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["text"] == detokenize(url, expected["sql"])
    base = complete(url, "base", prompt).json()
    assert base["model"] == "base" and base["choices"][0]["text"] != r.json()["choices"][0]["text"]
    models = httpx.get(f"{url}/v1/models", headers=HEADERS).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("base", None), ("sql", "base")]

    assert complete(url, "poet", prompt).status_code == 404
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS,
                        json={"lora_name": "poet", "lora_path": str(paths["poet"])})
    assert loaded.status_code == 200, loaded.text
    poet = complete(url, "poet", prompt).json()
    assert poet["choices"][0]["text"] == detokenize(url, expected["poet"])
    chat = httpx.post(f"{url}/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={"model": "poet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "poet"

    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS,
                       json={"lora_name": "poet", "lora_path": str(paths["poet"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "poet"}).status_code == 200
    gone = complete(url, "poet", prompt)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "poet"})
    assert missing.status_code == 404


def test_bad_adapter_requests(setup, tmp_path) -> None:
    url, llama, paths, _ = setup
    bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=HEADERS,
                     json={"lora_name": "nothing", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/load_lora_adapter",
                      json={"lora_name": "x", "lora_path": str(paths["poet"])}).status_code == 401  # no key
    emb = httpx.post(f"{url}/v1/embeddings", headers=HEADERS, json={"model": "sql", "input": "hi"})
    assert emb.status_code == 400 and emb.json()["error"]["param"] == "model"
    assert complete(url, "base", llama.prompts[2]).status_code == 200  # still serving
