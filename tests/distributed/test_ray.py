"""The Ray backend: a local Ray cluster on the loopback address (started here), two actors in a
placement group, the same tokens as one rank."""
from __future__ import annotations

import os

import pytest

from dabba import LLM, SamplingParams
from tests.conftest import token_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    if os.environ.get("CI"):
        import ray  # CI installs the dev extra: Ray must be there
    else:
        ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_tp2_on_ray_actors_matches_one_rank(checkpoints, ray_cluster) -> None:
    from dabba.executor.ray_executor import RayExecutor

    ckpt = checkpoints["qwen3"]
    prompts = token_prompts(ckpt.prompts[:4])
    whole = LLM(str(ckpt.path), dtype="float32", max_model_len=512)
    split = LLM(str(ckpt.path), dtype="float32", max_model_len=512, tensor_parallel_size=2,
                distributed_executor_backend="ray")
    try:
        executor = split.llm_engine.engine_core.executor
        assert isinstance(executor, RayExecutor) and executor.shm_path is not None  # one host
        expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in split.generate(prompts, GREEDY, use_tqdm=False)] == expected
    finally:
        split.llm_engine.shutdown()
    groups = ray_cluster.util.placement_group_table().values()
    assert groups and all(g["state"] == "REMOVED" for g in groups)  # shutdown gave the bundles back


def test_data_parallel_replicas_on_ray_actors_match_one_engine(checkpoints, ray_cluster) -> None:
    import asyncio

    from dabba.config import EngineConfig
    from dabba.engine.data_parallel import DataParallelEngine, build_replicas
    from dabba.executor.ray_executor import RayExecutor

    ckpt = checkpoints["qwen3"]
    whole = LLM(str(ckpt.path), dtype="float32", max_model_len=512)
    expected = [o.outputs[0].token_ids for o in whole.generate(token_prompts(ckpt.prompts[:4]), GREEDY, use_tqdm=False)]
    engines = build_replicas(EngineConfig.from_kwargs(model=str(ckpt.path), dtype="float32", max_model_len=512,
                                                      data_parallel_size=2, distributed_executor_backend="ray"))
    dp = DataParallelEngine(engines, "tiny")

    async def one(i: int) -> list[int]:
        async for out in await dp.add_request(f"r{i}", {"prompt_token_ids": ckpt.prompts[i]}, GREEDY):
            pass
        return out.outputs[0].token_ids

    async def every() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(4))))

    try:
        assert all(isinstance(e.engine_core.executor, RayExecutor) for e in engines)  # a one-CPU bundle each
        assert asyncio.run(every()) == expected
        assert dp.router.routed == [2, 2]
    finally:
        dp.shutdown()
        for engine in engines:
            engine.shutdown()
