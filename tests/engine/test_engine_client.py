"""One suite for every EngineClient (engine/protocol.py): one engine's AsyncLLMEngine and the
data-parallel replicas' DataParallelEngine answer the same questions the same way, so that a
front end written against the protocol serves either (and, later, a router of several models)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Iterator

import pytest

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.config import EngineConfig
from dabba.engine.clients import make_engine_client
from dabba.engine.data_parallel import build_replicas
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.output_processor import IterationStats
from dabba.engine.protocol import EngineClient, EngineDeadError, InvalidRequest, RequestStream
from dabba.outputs import RequestOutput
from dabba.sampling_params import RequestOutputKind
from tests.conftest import token_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_OPTIONS = dict(dtype="float32", max_num_batched_tokens=256, kv_cache_memory=2**22)


@pytest.fixture(params=["one_engine", "data_parallel"])
def served(request, checkpoints):
    """The client, and its engines (for the test to hold their steps: never through the client)."""
    path = str(checkpoints["llama"].path)
    if request.param == "one_engine":
        engines = [LLMEngine(EngineConfig.from_kwargs(model=path, **ENGINE_OPTIONS))]
    else:
        engines = build_replicas(EngineConfig.from_kwargs(model=path, data_parallel_size=2, **ENGINE_OPTIONS))
    client = make_engine_client(engines if len(engines) > 1 else engines[0], "tiny")
    yield SimpleNamespace(client=client, engines=engines)
    client.shutdown()
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def client(served) -> EngineClient:
    return served.client


@contextlib.contextmanager
def steps_held(engines: list[LLMEngine]) -> Iterator[None]:
    """While held, the engines' loops apply commands (queries, aborts) but run no step, so what
    runs stays running whatever the speed of the machine."""
    held = threading.Event()
    held.set()
    for engine in engines:
        step = engine.step_with_stats

        def held_step(step=step):
            if held.is_set():
                time.sleep(0.002)
                return [], IterationStats()
            return step()

        engine.step_with_stats = held_step
    try:
        yield
    finally:
        held.clear()


async def collect(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out


def test_it_is_an_engine_client_with_the_models_facts(client, checkpoints) -> None:
    assert isinstance(client, EngineClient)
    arch = ArchConfig.from_hf(checkpoints["llama"].path)
    info = client.model_info
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == arch.vocab_size
    assert info.block_size == 16 and info.max_model_len == arch.max_position_embeddings
    assert info.tokenizer.decode(info.tokenizer.encode("hello world")) == "hello world"


def test_outputs_are_one_engines_tokens(client, checkpoints) -> None:
    ckpt = checkpoints["llama"]
    prompts = ckpt.prompts[:4]
    expected = [o.outputs[0].token_ids for o in
                LLM(str(ckpt.path), **ENGINE_OPTIONS).generate(token_prompts(prompts), GREEDY, use_tqdm=False)]

    async def run() -> list[list[int]]:
        streams = [await client.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(prompts)]
        return [(await collect(s)).outputs[0].token_ids for s in streams]

    assert asyncio.run(run()) == expected


def test_a_text_prompt_is_tokenized_by_the_client_and_n_samples_fan_out(client) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    out = asyncio.run(collect_one(client, "text", "hello world", params))
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == client.model_info.tokenizer.encode("hello world")
    assert [o.index for o in out.outputs] == [0, 1, 2] and all(len(o.token_ids) == 4 for o in out.outputs)


async def collect_one(client: EngineClient, request_id: str, prompt, params: SamplingParams) -> RequestOutput:
    return await collect(await client.add_request(request_id, prompt, params))


@pytest.mark.parametrize("prompt, params, priority, param", [
    ({"prompt_token_ids": [5, 10**6]}, GREEDY, 0, "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=100), 0, "prompt"),
    ({"prompt_token_ids": []}, GREEDY, 0, "prompt"),
    ({"prompt_token_ids": [5]}, SamplingParams(logit_bias={10**6: 1.0}), 0, "logit_bias"),
    ({"prompt_token_ids": [5]}, SamplingParams(structured_outputs={"grammar": "root ::= ("}), 0,
     "structured_outputs"),
    ({"prompt_token_ids": [5]}, GREEDY, 2**63, "priority"),
    (42, GREEDY, 0, "prompt"),
])
def test_a_bad_request_is_an_invalid_request_naming_its_field(client, prompt, params, priority, param) -> None:
    async def run() -> None:
        with pytest.raises(InvalidRequest) as caught:
            await client.add_request("bad", prompt, params, priority)
        assert caught.value.param == param, caught.value
        assert (await client.get_stats()).num_waiting_reqs == 0  # nothing of it was queued
        ok = await collect_one(client, "after", {"prompt_token_ids": [5, 6]}, GREEDY)  # the engine serves on
        assert len(ok.outputs[0].token_ids) == 8

    asyncio.run(run())


def test_a_request_id_in_use_is_refused(served) -> None:
    client = served.client

    async def run() -> None:
        with steps_held(served.engines):  # the first one still runs when the second arrives
            stream = await client.add_request("same", {"prompt_token_ids": [5, 6]}, GREEDY)
            with pytest.raises(InvalidRequest) as caught:
                await client.add_request("same", {"prompt_token_ids": [7, 8]}, GREEDY)
        await collect(stream)
        return caught.value.param

    assert asyncio.run(run()) == "request_id"  # data-parallel: whichever replica holds it


def test_abort_frees_the_request_and_stats_snapshots_and_metrics_answer(served) -> None:
    client = served.client

    async def run() -> tuple:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        stream = await client.add_request("long", {"prompt_token_ids": list(range(5, 40))}, long)
        outputs = stream.__aiter__()
        first = await anext(outputs)  # it runs now
        with steps_held(served.engines):
            running = await client.get_stats()
            snapshot = await client.get_snapshot()
            client.abort("long")
            stats = await client.get_stats()  # the abort was applied before this was answered
        watcher = client.watch_stats()
        watched = await anext(watcher)
        await watcher.aclose()
        return first, running, snapshot, stats, watched, await client.render_metrics()

    first, running, snapshot, stats, watched, metrics = asyncio.run(run())
    assert len(first.outputs[0].token_ids) >= 1 and running.num_running_reqs == 1 and running.kv_blocks_used >= 3
    assert snapshot["running"] == 1 and snapshot["kv"]["block_size"] == 16
    assert stats.num_running_reqs == stats.num_waiting_reqs == stats.kv_blocks_used == 0
    assert watched["running"] == 0 and len(watched["kv"]["grid"]) == watched["kv"]["blocks"]
    assert b"dabba:generation_tokens_total" in metrics and b"dabba:num_requests_running" in metrics


def test_drain_then_shutdown(client) -> None:
    assert client.is_running and not client.is_draining and client.error is None
    asyncio.run(collect_one(client, "one", {"prompt_token_ids": [5, 6]}, GREEDY))
    assert client.drain(30) is True and client.is_draining

    async def refused() -> None:
        with pytest.raises(EngineDeadError, match="shutting down"):
            await client.add_request("late", {"prompt_token_ids": [5]}, GREEDY)

    asyncio.run(refused())
    client.shutdown()
    assert not client.is_running
