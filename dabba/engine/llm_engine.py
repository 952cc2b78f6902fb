"""The synchronous engine: add requests, then step until done.

step() = Scheduler.schedule -> ModelRunner.execute_model -> Scheduler.update_from_output (EngineCoreOutputs)
-> OutputProcessor.process_outputs (RequestOutputs, stop strings found) -> Scheduler.finish_requests.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dabba.config import EngineConfig
from dabba.core.kv_cache_manager import KVCacheManager
from dabba.core.request import Request, RequestStatus
from dabba.core.scheduler import Scheduler
from dabba.core.stats import SchedulerStats
from dabba.engine.output_processor import IterationStats, OutputProcessor
from dabba.engine.tokenizer import Tokenizer
from dabba.executor.selector import make_executor
from dabba.executor.uniproc import UniProcExecutor
from dabba.models.config import ArchConfig
from dabba.models.files import read_json_object
from dabba.models.hub import TOKENIZER_FILES, resolve_model_dir
from dabba.outputs import RequestOutput
from dabba.quantization.config import QuantConfig
from dabba.sampling_params import SamplingParams
from dabba.structured_output.manager import StructuredOutputManager
from dabba.worker.model_runner import ModelRunner, RunnerArgs

logger = logging.getLogger("dabba")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

PromptType = str | dict[str, Any]

GRAMMAR_WAIT_S = 0.01  # a step with nothing to run but grammars compiling waits this long for one


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype == "auto":
        return _DTYPES.get(checkpoint_dtype or "float32", torch.float32)
    return _DTYPES[dtype]


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {limit} tokens")
    return requested


def load_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return read_json_object(path) if path.is_file() else {}


class LLMEngine:
    def __init__(self, config: EngineConfig, replica: int | None = None) -> None:
        """``replica``: which of ``data_parallel_size`` replicas this engine is (its cores); the
        replicas serve together behind `dabba serve` (engine/data_parallel.py)."""
        replicas = config.parallel_config.data_parallel_size
        if replica is None and replicas > 1:
            raise ValueError(f"data_parallel_size={replicas}: replicas serve together behind `dabba serve "
                             f"--data-parallel-size {replicas}`; one engine here runs one model (data_parallel_size=1)")
        self.config = config
        mc = config.model_config
        model_dir = resolve_model_dir(mc.model, mc.revision, mc.download_dir)
        tokenizer_dir = (model_dir if mc.tokenizer is None else
                         resolve_model_dir(mc.tokenizer, None, mc.download_dir, TOKENIZER_FILES, field="tokenizer"))
        self.arch = ArchConfig.from_hf(model_dir)
        self.tokenizer = Tokenizer(tokenizer_dir)
        self.generation_config = load_generation_config(model_dir)
        self.max_model_len = resolve_max_model_len(mc.max_model_len, self.arch)
        self.eos_token_ids = self._eos_token_ids()

        if self.arch.quantization_config and mc.quantization:
            raise ValueError(f"quantization={mc.quantization!r}: this checkpoint is already quantized "
                             f"({self.arch.quantization_config.get('quant_method')})")
        quant_config = (QuantConfig.from_checkpoint(self.arch.quantization_config) if self.arch.quantization_config
                        else QuantConfig(mc.quantization) if mc.quantization else None)
        cc = config.cache_config
        spec = config.scheduler_config.speculative_config
        if spec is not None and spec.model is not None:  # a draft model given as a Hub id is fetched like the target
            spec = dataclasses.replace(spec, model=str(resolve_model_dir(spec.model, None, mc.download_dir)))
        self.executor = make_executor(RunnerArgs(
            str(model_dir), self.arch, resolve_dtype(mc.dtype, self.arch.torch_dtype), resolve_device(mc.device),
            self.max_model_len, mc.seed, mc.attention_backend, quant_config, cc.kv_cache_dtype, mc.native_layer_loop,
            spec,
        ), config.parallel_config, replica or 0)
        sc = config.scheduler_config
        self.cache_layout = self.executor.initialize_kv_cache(cc, sc.max_num_seqs, sc.max_num_batched_tokens)
        self.kv_cache_manager = KVCacheManager(self.cache_layout.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                               self.cache_layout.groups, sc.max_num_batched_tokens)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.max_model_len,
                                   self.structured_output, self.executor.row_blocks())
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_step_num_tokens = 0  # tokens the last step ran (the dashboard's tokens per step)

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process ModelRunner (tensor_parallel_size 1: its model, cache and layer loop)."""
        if not isinstance(self.executor, UniProcExecutor):
            raise AttributeError(f"the model runs in {self.executor.tp_size} worker processes, not in this one")
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the worker processes, if any (they also stop when the engine is collected)."""
        self.executor.shutdown()

    def _eos_token_ids(self) -> frozenset[int]:
        """generation_config's eos ids (config.json's when it has none), plus the tokenizer's eos."""
        gen_eos = self.generation_config.get("eos_token_id", list(self.arch.eos_token_ids))
        ids = set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def default_sampling_params(self) -> SamplingParams:
        """Defaults from generation_config.json, as the checkpoint's authors meant them."""
        gen = self.generation_config
        if not gen.get("do_sample", True):
            return SamplingParams(temperature=0.0)
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        defaults = {k: gen[k] for k in keys if gen.get(k) is not None}
        if defaults.get("top_k") == 0:  # transformers' "disabled"
            defaults["top_k"] = -1
        return SamplingParams(**defaults)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        """Queue one prompt (n samples of it); raises ValueError, and queues nothing, if it is
        invalid or can never fit."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._parse_prompt(prompt)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must be an integer in [-2**63, 2**63), got {priority!r}")
        params.check_vocab(self.arch.vocab_size)
        if params.structured_outputs is not None:  # validated now, compiled in the background
            self.structured_output.submit(params.structured_outputs)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(self.max_model_len - len(token_ids), 1))
        children = []
        for i in range(params.n):
            # n samples = n requests: the prompt's full blocks are shared through the prefix cache.
            child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            children.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                block_size=self.kv_cache_manager.block_size,
            ))
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child)
        except ValueError:
            for child in added:
                self.scheduler.abort_request(child.request_id)
            raise
        self.output_processor.add_request(request_id, text, token_ids, params, [c.request_id for c in children])

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains ids outside [0, {self.arch.vocab_size}): {bad[:5]}")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def abort_request(self, request_id: str) -> None:
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.abort_request(child_id)
        self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLMEngine.reset_prefix_cache: False while requests are unfinished."""
        return not self.has_unfinished_requests() and self.scheduler.kv_cache_manager.reset_prefix_cache()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for each prompt that has one to give under its
        output kind (its ``finished`` flag says whether all its samples are done)."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        """step(), plus what the step generated per prompt, for metrics whatever the output kind."""
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.scheduler.waiting_for_grammar():
            self.structured_output.wait_for_grammars(GRAMMAR_WAIT_S)  # rather than spin
        runner_out = self.executor.execute_model(sched_out)
        self.last_step_num_tokens = sched_out.total_num_scheduled_tokens
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        processed = self.output_processor.process_outputs(core_outputs)
        # Stop strings are found in the text, which only the engine holds: the scheduler learns by id.
        self.scheduler.finish_requests(processed.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
        self.scheduler.record_step_time(sched_out, runner_out, time.perf_counter() - start)
        return processed.request_outputs, processed.iteration_stats

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
