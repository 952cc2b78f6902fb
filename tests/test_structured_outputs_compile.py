"""Where constraints compile (structured_output/compile_pool.py): worker processes in two lanes, so
that a huge constraint holds up neither a small one nor the engine; a compile nobody waits for
any more (its deadline passed, its client left) is stopped by killing its worker; only what
compiled is cached; a full lane refuses at once.

The slow constraints are a JSON schema enum of 100,000 strings, which xgrammar compiles for
minutes (the hardening probe measured 145 s on these machines), and the same strings as a
regex's alternatives (about 20 s), so every check here that one is still compiling, or that a
deadline of a second passed first, holds by a wide margin."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import xgrammar as xgr

from dabba.config import DEMO_MODEL
from dabba.engine.async_engine import wait_compiled
from dabba.engine.tokenizer import Tokenizer
from dabba.errors import InvalidRequest, Overloaded
from dabba.structured_output import StructuredOutputsParams
from dabba.structured_output import compile_pool
from dabba.structured_output.compile_pool import CompileCancelled, compiler_pool
from dabba.structured_output.manager import StructuredOutputManager

HUGE_ENUM = StructuredOutputsParams(json={"enum": [f"value{i}" for i in range(100_000)]})
# The same strings as a regex's alternatives: seconds to build, tens of seconds to compile.
HUGE_REGEX = StructuredOutputsParams(regex="(" + "|".join(f"value{i}" for i in range(100_000)) + ")")


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    tokenizer = Tokenizer(DEMO_MODEL)
    vocab_size = json.loads(open(f"{DEMO_MODEL}/config.json").read())["vocab_size"]
    return StructuredOutputManager(tokenizer, vocab_size, frozenset({0}))


def regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=pattern)


def when_running(compilation):
    """Once its lane runs it (a bound on a hang only)."""
    deadline = time.monotonic() + 120
    while compilation.lane.running is not compilation:
        assert time.monotonic() < deadline and not compilation.future.done()
        time.sleep(0.01)
    return compilation


def settled(compilation) -> BaseException | None:
    """The compile's outcome once it settles (a bound on a hang only)."""
    return compilation.future.exception(timeout=120)


def test_a_huge_compile_holds_up_no_small_one_and_stops_when_nobody_waits(manager) -> None:
    huge = manager.compile(HUGE_ENUM)
    small = manager.compile(regex("[a-c]{3}"))
    assert isinstance(small.future.result(timeout=120), xgr.CompiledGrammar)
    assert not huge.future.done() and huge.lane.name == "large" and small.lane.name == "small"
    worker = huge.lane.worker
    manager.release(small)
    manager.release(huge)  # the last claim: the lane kills the worker compiling it
    assert isinstance(settled(huge), CompileCancelled)
    assert worker.process.poll() is not None
    pool = compiler_pool()
    assert small.key in pool._cache and huge.key not in pool._cache  # what compiled is kept, what stopped is not
    again = manager.compile(HUGE_ENUM)  # starts afresh (a new worker), and stops again
    assert again is not huge and not again.future.done()
    manager.release(again)
    assert isinstance(settled(again), CompileCancelled)


def test_equal_constraints_share_one_compile_then_the_cache(manager) -> None:
    first, second = manager.compile(regex("[x-z]{2}q")), manager.compile(regex("[x-z]{2}q"))
    assert first is second and first.claims == 2
    compiled = first.future.result(timeout=120)
    manager.release(first)
    manager.release(second)
    cached = manager.compile(regex("[x-z]{2}q"))
    assert cached.future.result(timeout=0) is compiled
    manager.release(cached)


@pytest.mark.parametrize("params", [HUGE_ENUM, HUGE_REGEX], ids=["enum", "regex"])
def test_a_deadline_releases_the_claim_and_stops_the_compile(manager, params) -> None:
    huge = manager.compile(params)
    with pytest.raises(InvalidRequest, match="did not compile within 1 s") as e:
        asyncio.run(wait_compiled(huge, manager, timeout=1.0))
    assert e.value.param == "structured_outputs"
    assert isinstance(settled(huge), CompileCancelled)


def test_a_caller_that_leaves_stops_the_compile(manager) -> None:
    huge = manager.compile(HUGE_ENUM)

    async def leave() -> None:
        task = asyncio.ensure_future(wait_compiled(huge, manager, timeout=None))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    assert isinstance(settled(huge), CompileCancelled)


def test_a_full_lane_refuses_at_once_and_queued_compiles_leave_with_their_claims(manager, monkeypatch) -> None:
    monkeypatch.setattr(compile_pool, "MAX_QUEUED_PER_LANE", 1)
    running = when_running(manager.compile(HUGE_ENUM))
    queued = manager.compile(StructuredOutputsParams(json={"enum": [f"other{i}" for i in range(100_000)]}))
    with pytest.raises(Overloaded, match="already waiting to compile"):
        manager.compile(StructuredOutputsParams(json={"enum": [f"third{i}" for i in range(100_000)]}))
    manager.release(queued)  # dropped from the queue without ever running
    assert isinstance(settled(queued), CompileCancelled)
    manager.release(running)
    assert isinstance(settled(running), CompileCancelled)


def test_a_worker_that_dies_fails_only_its_compile(manager) -> None:
    huge = when_running(manager.compile(HUGE_ENUM))
    huge.lane.ensure_worker().process.kill()  # as the kernel's OOM killer would
    error = settled(huge)
    assert isinstance(error, InvalidRequest) and "exited" in str(error)
    manager.release(huge)
    fresh = manager.compile(StructuredOutputsParams(json={"enum": [f"fresh{i}" for i in range(1000)]}))  # large, quick
    assert fresh.lane is huge.lane and isinstance(fresh.future.result(timeout=120), xgr.CompiledGrammar)
    manager.release(fresh)


@pytest.mark.parametrize("fields, message", [
    ({"grammar": "root ::= root"}, "admits no output"),  # no first token: known when compiled
    ({"regex": "a(b"}, "structured_outputs.regex is invalid"),  # refused as the worker builds it
])
def test_constraints_that_admit_nothing_are_invalid_requests(manager, fields, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        compilation = manager.compile(StructuredOutputsParams(**fields))
        try:
            compilation.future.result(timeout=120)
        finally:
            manager.release(compilation)
