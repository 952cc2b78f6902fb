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
AUTH = {"Authorization": f"Bearer {API_KEY}"}
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
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=AUTH).json()
    expected = server.engine.model_info.tokenizer.encode("<|user|>\nhi</s>\n<|assistant|>\n", add_special_tokens=False)
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
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH).json()["tokens"]
    assert ids == server.engine.model_info.tokenizer.encode("Hello world")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=AUTH).json()["prompt"] == "<s>Hello world"
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


def test_a_client_that_disconnects_leaves_nothing_running(server, monkeypatch) -> None:
    """A client that hangs up (streaming or not) gets its request aborted and its KV blocks freed.

    Nothing here races a clock: the client hangs up once /metrics shows the request running with
    a token made, and the engine holds the request there until the abort reaches it (else the tiny
    model could make all 480 tokens before the server, which looks every DISCONNECT_POLL_S,
    notices), so "aborted, not run to the end" is observed, not inferred from speed."""
    import json
    import socket
    import threading

    class HoldAfterFirstToken:
        """Once the model ran (the prefill of the one-token prompt samples its first token), the
        engine reports no unfinished requests, so its loop only waits for commands, until
        abort_request() ran; it records the requests it aborted while they were unfinished."""

        def __init__(self) -> None:
            engine = server.engine
            self.model_ran = threading.Event()
            self.aborted = threading.Event()
            self.aborted_live: list[str] = []
            self.execute_model = engine.engine_core.model_runner.execute_model
            self.has_unfinished_requests = engine.has_unfinished_requests
            self.abort_request = engine.abort_request
            monkeypatch.setattr(engine.engine_core.model_runner, "execute_model", self.recorded_execute_model)
            monkeypatch.setattr(engine, "has_unfinished_requests", self.held_has_unfinished_requests)
            monkeypatch.setattr(engine, "abort_request", self.recorded_abort_request)

        def recorded_execute_model(self, *args, **kwargs):
            out = self.execute_model(*args, **kwargs)
            self.model_ran.set()
            return out

        def held_has_unfinished_requests(self) -> bool:
            if self.model_ran.is_set() and not self.aborted.is_set():
                return False
            return self.has_unfinished_requests()

        def recorded_abort_request(self, request_id: str) -> None:
            if self.has_unfinished_requests():
                self.aborted_live.append(request_id)
            self.abort_request(request_id)
            self.aborted.set()

    def wait_until(condition, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.02)

    def running_with_a_token(before: float) -> bool:
        return (metric(server, "dabba:num_requests_running") == 1
                and metric(server, "dabba:generation_tokens_total") > before)

    def check_aborted(hold: HoldAfterFirstToken, before: float) -> None:
        assert hold.aborted.wait(60), "the server never aborted the request"
        assert len(hold.aborted_live) == 1, hold.aborted_live  # aborted while it ran, not after it ended
        wait_idle(server)  # its KV blocks freed
        assert metric(server, "dabba:generation_tokens_total") - before < 480, "it ran to the end instead"
        monkeypatch.undo()

    wait_idle(server)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 480, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    # streaming: hang up after the first token, while the request runs
    hold = HoldAfterFirstToken()
    before = metric(server, "dabba:generation_tokens_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        wait_until(lambda: running_with_a_token(before), "the request runs and made a token")
    check_aborted(hold, before)

    # non-streaming: the client sends the request on a raw socket and closes it while it runs
    hold = HoldAfterFirstToken()
    before = metric(server, "dabba:generation_tokens_total")
    url = httpx.URL(server.url)
    payload = json.dumps({**body, "stream": False}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
               f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection((url.host, url.port), timeout=60) as sock:
        sock.sendall(request)
        wait_until(lambda: running_with_a_token(before), "the request runs and made a token")
    check_aborted(hold, before)


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


def test_streams_with_stop_strings_logprobs_and_echo_equal_the_single_responses(server, reference) -> None:
    """Streams take DELTA outputs, single responses FINAL_ONLY: text held back for a stop string,
    the echoed prompt and every token's logprobs reach the streaming client once, in order."""
    ref = reference[PROMPTS[2]]
    stop = ref[5:9]
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop], logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    full = server.client.completions.create(**kwargs).model_dump()
    chunks = list(server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == full["choices"][0]["text"] == PROMPTS[2] + ref[: ref.index(stop)]
    for field in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for c in choices for x in getattr(c.logprobs, field)] == full["choices"][0]["logprobs"][field]
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full["usage"]

    messages = [{"role": "user", "content": "What is JSON?"}]
    chat = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    text = server.client.chat.completions.create(**chat).choices[0].message.content
    # 3 characters that first occur mid-reply: a stop string with text held back
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3)
                if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    full = server.client.chat.completions.create(stop=[stop], **chat)
    chunks = list(server.client.chat.completions.create(stop=[stop], stream=True,
                                                        stream_options={"include_usage": True}, **chat))
    choices = [c.choices[0] for c in chunks if c.choices]
    streamed = "".join(c.delta.content or "" for c in choices)
    assert streamed == full.choices[0].message.content == text[: text.index(stop)]
    assert [t for c in choices if c.logprobs for t in c.logprobs.content] == full.choices[0].logprobs.content
    assert (choices[-1].finish_reason, choices[-1].stop_reason) == ("stop", stop) == (full.choices[0].finish_reason,
                                                                                     full.choices[0].stop_reason)
    assert chunks[-1].usage == full.usage


def test_metrics_count_streams_and_single_responses_alike(server) -> None:
    """Metrics come from each step's stats, whatever the outputs carry (FINAL_ONLY: one output)."""
    names = ["dabba:prompt_tokens_total", "dabba:generation_tokens_total", "dabba:time_to_first_token_seconds_count",
             "dabba:time_per_output_token_seconds_count", "dabba:e2e_request_latency_seconds_count"]
    num_prompt_tokens = len(server.engine.model_info.tokenizer.encode(PROMPTS[1]))
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, n=2, temperature=0, extra_body={"ignore_eos": True})
    wait_idle(server)
    for stream in (False, True):
        before = {name: metric(server, name) for name in names}
        response = server.client.completions.create(stream=stream, **kwargs)
        if stream:
            list(response)
        # n=2 counts the prompt twice, as before outputs travelled as deltas
        assert {name: metric(server, name) - before[name] for name in names} == dict(zip(names, [
            2 * num_prompt_tokens, 2 * 5, 1, 1, 1]))
