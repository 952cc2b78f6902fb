"""The synchronous engine: add requests, then step until done, all on the caller's thread.

It is the three halves of a request's path put together: the Processor (tokenize, validate, fan
out), the EngineCore (schedule -> run the model -> update) and the OutputProcessor (text, stop
strings, RequestOutputs):

add_request = Processor.process -> EngineCore.add_request + OutputProcessor.add_request
step()      = EngineCore.step (EngineCoreOutputs) -> OutputProcessor.process_outputs (RequestOutputs,
              stop strings found) -> EngineCore.finish_step (those requests finish)
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from dabba.config import EngineConfig
from dabba.core.stats import SchedulerStats
from dabba.engine.core import EngineCore
from dabba.engine.model_info import ModelInfo
from dabba.engine.output_processor import IterationStats, OutputProcessor
from dabba.engine.processor import EngineRequest, Processor, PromptType
from dabba.engine.tokenizer import Tokenizer
from dabba.errors import InvalidRequest
from dabba.arch.config import ArchConfig
from dabba.arch.files import read_json_object
from dabba.models.hub import TOKENIZER_FILES, resolve_model_dir
from dabba.outputs import RequestOutput
from dabba.quantization.config import QuantConfig
from dabba.sampling_params import SamplingParams
from dabba.worker.model_runner import RunnerArgs

logger = logging.getLogger("dabba")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        arch = ArchConfig.from_hf(model_dir)
        tokenizer = Tokenizer(tokenizer_dir)
        generation_config = load_generation_config(model_dir)
        max_model_len = resolve_max_model_len(mc.max_model_len, arch)
        eos_token_ids = _eos_token_ids(generation_config, arch, tokenizer)

        if arch.quantization_config and mc.quantization:
            raise ValueError(f"quantization={mc.quantization!r}: this checkpoint is already quantized "
                             f"({arch.quantization_config.get('quant_method')})")
        quant_config = (QuantConfig.from_checkpoint(arch.quantization_config) if arch.quantization_config
                        else QuantConfig(mc.quantization) if mc.quantization else None)
        cc = config.cache_config
        spec = config.scheduler_config.speculative_config
        if spec is not None and spec.model is not None:  # a draft model given as a Hub id is fetched like the target
            spec = dataclasses.replace(spec, model=str(resolve_model_dir(spec.model, None, mc.download_dir)))
        runner_args = RunnerArgs(
            str(model_dir), arch, resolve_dtype(mc.dtype, arch.torch_dtype), resolve_device(mc.device),
            max_model_len, mc.seed, mc.attention_backend, quant_config, cc.kv_cache_dtype, mc.native_layer_loop, spec,
        )
        self.arch = arch
        self.engine_core = EngineCore(config, runner_args, tokenizer, eos_token_ids, replica or 0)
        self.model_info = ModelInfo(arch.architecture, tokenizer, max_model_len, arch.vocab_size, eos_token_ids,
                                    cc.block_size, generation_config)
        self.processor = Processor(self.model_info, self.engine_core.structured_output)
        self.output_processor = OutputProcessor(tokenizer)

    def shutdown(self) -> None:
        """Stop the worker processes, if any (they also stop when the engine is collected)."""
        self.engine_core.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        return self.model_info.default_sampling_params()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        """Queue one prompt (n samples of it); raises InvalidRequest (a ValueError), and queues
        nothing, if it is invalid or can never fit."""
        self.add_processed(self.processor.process(request_id, prompt, params, priority))

    def add_processed(self, request: EngineRequest) -> None:
        """Queue a prompt the Processor made (an async front end processes off this thread)."""
        if request.request_id in self.output_processor.parents:
            raise InvalidRequest("request_id", f"request_id {request.request_id!r} is already in use")
        self.engine_core.add_request(request)
        self.output_processor.add_request(request.request_id, request.prompt, request.prompt_token_ids,
                                          request.params, [sample.request_id for sample in request.samples])

    def abort_request(self, request_id: str) -> None:
        self.engine_core.abort_requests(self.output_processor.child_ids(request_id))
        self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """vLLM's LLMEngine.reset_prefix_cache: False while requests are unfinished."""
        return self.engine_core.reset_prefix_cache()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for each prompt that has one to give under its
        output kind (its ``finished`` flag says whether all its samples are done)."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        """step(), plus what the step generated per prompt, for metrics whatever the output kind."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        self.engine_core.finish_step(processed.reqs_to_finish)
        return processed.request_outputs, processed.iteration_stats

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()


def _eos_token_ids(generation_config: dict[str, Any], arch: ArchConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """generation_config's eos ids (config.json's when it has none), plus the tokenizer's eos."""
    gen_eos = generation_config.get("eos_token_id", list(arch.eos_token_ids))
    ids = set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
