"""Several models behind one router (engine/model_router.py): load on first use, keep-alive expiry,
LRU eviction by planned footprint, refusals (503 with Retry-After, 507), unloads that let their
requests finish; two models served at once each give transformers' greedy tokens. The clock is
the test's and loads wait on the test's gate where an order matters: no state here depends on timing."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterator

import pytest

from dabba.config import EngineConfig
from dabba.engine.llm_engine import LLMEngine
from dabba.engine.model_footprint import plan_footprint
from dabba.engine.model_router import ModelRouter, ModelSpec
from dabba.engine.protocol import ModelUnavailable
from dabba.sampling_params import SamplingParams
from tests.conftest import Checkpoint

OPTIONS = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory=4 * 2**20)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spec(name: str, checkpoint: Checkpoint, keep_alive: float | None = None, **options) -> ModelSpec:
    return ModelSpec(name, EngineConfig.from_kwargs(model=str(checkpoint.path), **{**OPTIONS, **options}), keep_alive)


@contextlib.contextmanager
def running(router: ModelRouter) -> Iterator[ModelRouter]:
    thread = threading.Thread(target=router.run_loop, daemon=True)
    thread.start()
    try:
        yield router
    finally:
        router.shutdown()
        thread.join(timeout=30)


def states(router: ModelRouter) -> dict[str, str]:
    return {name: e.state.value for name, e in router.entries.items()}


async def generate(router: ModelRouter, name: str, prompt: list[int], max_tokens: int, request_id: str) -> list[int]:
    async with router.lease(name) as entry:
        stream = await entry.client.add_request(request_id, {"prompt_token_ids": prompt},
                                                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    async for out in stream:  # the lease ended: the request in flight keeps the model busy
        pass
    return out.outputs[0].token_ids


def test_two_models_load_on_first_use_and_each_equals_its_own_reference(checkpoints):
    llama, qwen = checkpoints["llama"], checkpoints["qwen2"]
    router = ModelRouter([spec("llama", llama), spec("qwen", qwen)], 2**30)
    assert states(router) == {"llama": "unloaded", "qwen": "unloaded"}

    async def main() -> None:
        both = await asyncio.gather(generate(router, "llama", llama.prompts[3], 12, "a"),
                                    generate(router, "qwen", qwen.prompts[3], 12, "b"),
                                    generate(router, "llama", llama.prompts[5], 12, "c"))
        assert both == [llama.reference[3][:12], qwen.reference[3][:12], llama.reference[5][:12]]
        assert states(router) == {"llama": "loaded", "qwen": "loaded"}
        with pytest.raises(ModelUnavailable) as e:
            await router.acquire("gpt-4")
        assert e.value.status == 404 and "llama, qwen" in e.value.message and str(llama.path) not in e.value.message

    with running(router):
        asyncio.run(main())


def test_keep_alive_expiry_and_a_requests_own_keep_alive(checkpoints):
    clock = Clock()
    router = ModelRouter([spec("llama", checkpoints["llama"], keep_alive=10.0)], 2**30, clock=clock)

    async def main() -> None:
        entry = await router.acquire("llama")
        clock.now = 100.0
        router.touch()
        assert router.expire() == []  # leased: never idle
        router.release(entry)  # idle from 100
        clock.now = 109.9
        assert router.expire() == []
        clock.now = 110.0
        assert router.expire() == ["llama"] and states(router) == {"llama": "unloading"}
        await router.entries["llama"].transition
        assert states(router) == {"llama": "unloaded"}

        async with router.lease("llama", keep_alive=None):  # a negative keep_alive: loaded for good
            pass
        clock.now = 10**6
        assert router.expire() == [] and states(router) == {"llama": "loaded"}
        async with router.lease("llama", keep_alive=0.0):  # 0: unloaded once idle
            pass
        assert router.expire() == ["llama"]
        await router.entries["llama"].transition

    with running(router):
        asyncio.run(main())


def test_a_load_unloads_the_least_recently_used_idle_model(checkpoints):
    llama, qwen, qwen3 = checkpoints["llama"], checkpoints["qwen2"], checkpoints["qwen3"]
    specs = [spec("a", llama), spec("b", qwen), spec("c", qwen3)]
    sizes = [plan_footprint(s.config)[0].total for s in specs]
    clock = Clock()
    # room for any two, not three
    router = ModelRouter(specs, sizes[0] + sizes[1] + sizes[2] - min(sizes) // 2, clock=clock)

    async def use(name: str, at: float) -> None:
        clock.now = at
        async with router.lease(name):
            pass

    async def main() -> None:
        await use("a", 1)
        await use("b", 2)
        await use("a", 3)  # b is now the least recently used
        await use("c", 4)
        assert states(router) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert router.used_memory() == sizes[0] + sizes[2]
        held = await router.acquire("a")  # a busy model is never unloaded: c goes, though used later
        clock.now = 5
        await use("b", 6)
        assert states(router) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        held_b = await router.acquire("b")
        with pytest.raises(ModelUnavailable) as e:  # both others busy: retry later
            await router.acquire("c")
        assert e.value.status == 503 and e.value.retry_after and "a, b serve requests" in e.value.message
        assert states(router)["c"] == "unloaded"
        router.release(held)
        router.release(held_b)

    with running(router):
        asyncio.run(main())


def test_a_model_larger_than_the_budget_is_507_and_a_broken_one_500(checkpoints, tmp_path):
    llama = checkpoints["llama"]
    need = plan_footprint(spec("a", llama).config)[0]
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    router = ModelRouter([spec("a", llama), ModelSpec("broken", EngineConfig.from_kwargs(model=str(tmp_path)))],
                         need.total - 1)

    async def main() -> None:
        with pytest.raises(ModelUnavailable) as e:
            await router.acquire("a")
        assert e.value.status == 507 and "KV cache" in e.value.message and "--models-memory" in e.value.message
        with pytest.raises(ModelUnavailable) as e:
            await router.acquire("broken")
        assert e.value.status == 500 and "broken" in e.value.message
        assert states(router) == {"a": "unloaded", "broken": "unloaded"}

    with running(router):
        asyncio.run(main())


def test_waiting_for_a_load_is_bounded(checkpoints):
    gate = threading.Event()

    def build(config: EngineConfig) -> LLMEngine:
        gate.wait(60)
        return LLMEngine(config)

    router = ModelRouter([spec("a", checkpoints["llama"])], 2**30, max_waiting=2, build_engine=build)

    async def main() -> None:
        first = asyncio.ensure_future(router.acquire("a"))
        second = asyncio.ensure_future(router.acquire("a"))
        await asyncio.sleep(0)
        assert states(router) == {"a": "loading"} and router.entries["a"].waiting == 2
        with pytest.raises(ModelUnavailable) as e:
            await router.acquire("a")
        assert e.value.status == 503 and e.value.retry_after >= 1 and "loading" in e.value.message
        gate.set()
        for entry in await asyncio.gather(first, second):
            router.release(entry)
        assert states(router) == {"a": "loaded"} and router.entries["a"].waiting == 0

    with running(router):
        asyncio.run(main())


def test_an_unload_lets_the_requests_in_flight_finish(checkpoints):
    llama = checkpoints["llama"]
    router = ModelRouter([spec("a", llama)], 2**30)

    async def main() -> None:
        running_request = asyncio.ensure_future(generate(router, "a", llama.prompts[4], 48, "long"))
        while router.entries["a"].client is None or router.entries["a"].client.num_in_flight == 0:
            await asyncio.sleep(0.01)
        unloading = asyncio.ensure_future(router.unload("a"))
        await asyncio.sleep(0)
        assert states(router) == {"a": "unloading"}
        assert await running_request == llama.reference[4][:48]  # every token, not an error
        await unloading
        assert states(router) == {"a": "unloaded"}
        # a request after the unload loads the model again
        assert await generate(router, "a", llama.prompts[2], 4, "again") == llama.reference[2][:4]
        assert states(router) == {"a": "loaded"}

    with running(router):
        asyncio.run(main())
