"""The real server on a loopback port, driven by the official `openai` client and raw HTTP."""
from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from dabba import LLM, SamplingParams

from tests.entrypoints.live_server import live_server

API_KEY = "sk-dabba-test"
MODEL = "tiny"
PROMPTS = ["The json module", "Return a new list", "def f(x):", "import os"]


@pytest.fixture(scope="module")
def server(checkpoints):
    path = str(checkpoints["llama"].path)
    with live_server(path, MODEL, API_KEY) as (url, engine):
        yield SimpleNamespace(url=url, engine=engine, path=path,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0))


@pytest.fixture(scope="module")
def reference(server) -> dict[str, str]:
    """Greedy 24-token continuations from the offline API on the same checkpoint."""
    llm = LLM(server.path, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf'^{re.escape(name)}{{model_name="{MODEL}"}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_idle(server, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while metric(server, "dabba:num_requests_running") or metric(server, "dabba:kv_cache_usage_perc"):
        assert time.time() < deadline, "requests still running / KV blocks still held"
        time.sleep(0.1)


def test_completions_match_offline_greedy(server, reference) -> None:
    for prompt in PROMPTS:
        r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert r.choices[0].text == reference[prompt]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0


def test_streaming_equals_non_streaming(server, reference) -> None:
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[PROMPTS[0]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JSON?"}]
    full = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 20


def test_chat_uses_the_checkpoints_template(server) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    expected = server.engine.tokenizer.encode("<|user|>\nhi</s>\n<|assistant|>\n", add_special_tokens=False)
    assert tokens["tokens"] == expected and tokens["count"] == len(expected)
    r = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == len(expected)


def test_n_seed_logprobs_and_stop(server, reference) -> None:
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=3, temperature=1.0,
                                         seed=7, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=3, temperature=1.0,
                                             seed=7, logprobs=2)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)

    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)

    ref = reference[PROMPTS[2]]
    stop = ref[5:9]
    r = server.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref[: ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"

    echo = server.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0, echo=True,
                                            extra_body={"ignore_eos": True})
    assert echo.choices[0].text == PROMPTS[3] + reference[PROMPTS[3]][: len(echo.choices[0].text) - len(PROMPTS[3])]


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": "x", "top_p": 5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 600}, 400, "prompt"),  # prompt + max_tokens > max_model_len
    ({"model": MODEL, "prompt": [1] * 600}, 400, "prompt"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(server, body, status, param) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in error["message"] and "pydantic" not in error["message"]


def test_auth_routes_and_malformed_bodies(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])


def test_info_routes(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids == server.engine.tokenizer.encode("Hello world")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == "<s>Hello world"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["dabba:num_requests_running", "dabba:num_requests_waiting", "dabba:kv_cache_usage_perc",
                 "dabba:prefix_cache_hit_rate", "dabba:num_preemptions_total", "dabba:prompt_tokens_total",
                 "dabba:kv_cache_tokens", "dabba:kv_cache_slot_utilization",
                 "dabba:generation_tokens_total", "dabba:time_to_first_token_seconds_bucket",
                 "dabba:time_per_output_token_seconds_bucket", "dabba:e2e_request_latency_seconds_bucket"]:
        assert name in text, name


def test_64_concurrent_streams_finish_correctly(server, reference) -> None:
    before = metric(server, "dabba:generation_tokens_total")

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def bad(client: openai.AsyncOpenAI, i: int) -> str:
        kwargs = [dict(top_p=7), dict(max_tokens=10_000), dict(extra_body={"logit_bias": {"-4": 1}})][i % 3]
        try:
            await client.completions.create(model=MODEL, prompt="x", stream=True, **{"max_tokens": 4, **kwargs})
        except openai.BadRequestError:
            return "rejected"
        return "accepted"

    async def main() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        good = [one(client, PROMPTS[i % 4]) for i in range(64)]
        rejected = [bad(client, i) for i in range(9)]  # interleaved with the good ones: they must not disturb them
        results = await asyncio.gather(*good, *rejected)
        return results[:64], results[64:]

    texts, rejected = asyncio.run(main())
    assert rejected == ["rejected"] * 9
    assert texts == [reference[PROMPTS[i % 4]] for i in range(64)]
    assert metric(server, "dabba:generation_tokens_total") - before == 64 * 24
    wait_idle(server)


def test_a_client_that_disconnects_leaves_nothing_running(server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 480, "temperature": 0, "stream": True, "ignore_eos": True}
    before = metric(server, "dabba:generation_tokens_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server, "dabba:num_requests_running") == 1
    wait_idle(server)  # aborted, its KV blocks freed
    assert metric(server, "dabba:generation_tokens_total") - before < 480, "it ran to the end instead"
    # the same for a non-streaming request whose client gives up (soon: the tiny model makes its
    # 480 tokens in a few tenths of a second, and the server looks every DISCONNECT_POLL_S)
    before = metric(server, "dabba:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.02)
    wait_idle(server)
    assert metric(server, "dabba:generation_tokens_total") - before < 480, "it ran to the end instead"


def test_streaming_several_prompts_and_samples(server) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=10, n=2, temperature=1.0, seed=3, logprobs=1)
    full = server.client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for chunk in server.client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.tokens)
    assert sorted(texts) == [0, 1, 2, 3]  # prompt i, sample j -> index 2 * i + j
    assert texts == {c.index: c.text for c in full.choices}
    assert tokens == {c.index: len(c.logprobs.tokens) for c in full.choices}

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=5, temperature=1.0)
    full = server.client.chat.completions.create(**chat)
    streamed: dict[int, str] = {}
    for chunk in server.client.chat.completions.create(stream=True, **chat):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in full.choices}
