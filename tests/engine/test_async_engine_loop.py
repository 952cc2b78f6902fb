"""The engine loop on the caller's thread (how `dabba serve` runs it, on the main thread): requests
fed from an event loop in another thread are served by that thread's steps, and shutdown() ends it."""
from __future__ import annotations

import asyncio
import threading

from dabba import LLM, SamplingParams
from dabba.engine.async_engine import AsyncLLMEngine, EngineDeadError


def serve_here(async_engine: AsyncLLMEngine, client) -> None:
    """Run ``client()`` on an event loop in another thread (the HTTP side) while this thread runs
    the engine loop, until the client is done and shut the loop down."""
    def http_side() -> None:
        try:
            asyncio.run(client())
        finally:
            async_engine.shutdown()

    other = threading.Thread(target=http_side)
    other.start()
    async_engine.run_loop()  # returns once shutdown() ran
    other.join(timeout=30)


def threads_calling(obj: object, name: str) -> list[int]:
    """Wrap ``obj.name`` so that each call appends its thread's id to the list returned."""
    calls, method = [], getattr(obj, name)

    def recording(*args, **kwargs):
        calls.append(threading.get_ident())
        return method(*args, **kwargs)

    setattr(obj, name, recording)
    return calls


def test_engine_loop_runs_on_the_calling_thread(checkpoints) -> None:
    engine = LLM(str(checkpoints["llama"].path), dtype="float32", kv_cache_memory=2**22).llm_engine
    stepped_on = threads_calling(engine, "step_with_stats")
    async_engine = AsyncLLMEngine(engine, "m", start_thread=False)
    result = {}

    async def client() -> None:
        stream = await async_engine.add_request("r", {"prompt_token_ids": [5, 6, 7]},
                                                SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        async for out in stream:
            result["tokens"] = out.outputs[0].token_ids

    serve_here(async_engine, client)
    assert len(result["tokens"]) == 5
    assert set(stepped_on) == {threading.get_ident()}
    assert not async_engine.is_running


def test_stats_are_taken_by_the_engine_thread_when_asked(checkpoints) -> None:
    """/metrics' snapshot: the engine thread takes it between steps (it alone reads the
    scheduler), and no step pays for it unasked; once the loop stopped, asking still answers and a
    new request is refused rather than left waiting."""
    engine = LLM(str(checkpoints["llama"].path), dtype="float32", kv_cache_memory=2**22).llm_engine
    asked_on = threads_calling(engine, "get_stats")
    # The second step waits until the snapshot is asked for, so the request (8 steps) is surely
    # still running when the engine thread takes it, however fast the steps are.
    real_step, steps, asked = engine.step_with_stats, [], threading.Event()

    def step():
        steps.append(1)
        if len(steps) == 2:
            assert asked.wait(60), "the snapshot was never asked for"
        return real_step()

    engine.step_with_stats = step
    async_engine = AsyncLLMEngine(engine, "m", start_thread=False)
    result = {}

    async def client() -> None:
        stream = await async_engine.add_request("r", {"prompt_token_ids": [5, 6, 7]},
                                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        async for out in stream:
            if "running" not in result:
                stats = asyncio.ensure_future(async_engine.get_stats())
                await asyncio.sleep(0)  # get_stats has queued its command
                asked.set()
                result["running"] = (await stats).num_running_reqs
        result["steps_asked"] = len(asked_on)
        result["after"] = (await async_engine.get_stats()).num_running_reqs

    serve_here(async_engine, client)
    assert result == {"running": 1, "steps_asked": 1, "after": 0}
    assert asked_on == [threading.get_ident()] * 2

    async def late_client() -> None:
        result["stopped"] = (await async_engine.get_stats()).num_running_reqs
        try:
            await async_engine.add_request("late", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=1))
        except EngineDeadError:
            result["refused"] = True

    asyncio.run(late_client())
    assert result["stopped"] == 0 and result["refused"]
