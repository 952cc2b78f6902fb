"""The synchronous engine: add requests, then step until done, all on the caller's thread.

It is the three halves of a request's path put together: the Processor (tokenize, validate, fan
out), the EngineCore (schedule -> run the model -> update) and the OutputProcessor (text, stop
strings, RequestOutputs):

add_request = Processor.process -> EngineCore.add_request + OutputProcessor.add_request
step()      = EngineCore.step (EngineCoreOutputs) -> OutputProcessor.process_outputs (RequestOutputs,
              stop strings found) -> EngineCore.finish_step (those requests finish)
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dabba.arch.config import ArchConfig
from dabba.config import EngineConfig
from dabba.core.stats import SchedulerStats
from dabba.engine.core import EngineCore
from dabba.engine.model_info import ModelInfo
from dabba.engine.output_processor import IterationStats, OutputProcessor
from dabba.engine.processor import EngineRequest, Processor, PromptType
from dabba.engine.prompt_images import image_prompt
from dabba.engine.tokenizer import Tokenizer
from dabba.errors import InvalidRequest
from dabba.lora_request import LoRARequest
from dabba.models.lora_adapter import AdapterLimits
from dabba.models.resolved_config import load_generation_config, resolve_config
from dabba.outputs import PoolingRequestOutput, RequestOutput
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import SamplingParams

logger = logging.getLogger("dabba")


class LLMEngine:
    def __init__(self, config: EngineConfig, replica: int | None = None) -> None:
        """``replica``: which of ``data_parallel_size`` replicas this engine is (its cores); the
        replicas serve together behind `dabba serve` (engine/data_parallel.py)."""
        replicas = config.parallel_config.data_parallel_size
        if replica is None and replicas > 1:
            raise ValueError(f"data_parallel_size={replicas}: replicas serve together behind `dabba serve "
                             f"--data-parallel-size {replicas}`; one engine here runs one model (data_parallel_size=1)")
        self.config = config
        self.resolved = resolve_config(config)  # the one resolved configuration: the ranks get a copy
        arch, model_dir = self.resolved.arch, Path(self.resolved.model_dir)
        tokenizer = Tokenizer(self.resolved.tokenizer_dir, config.model_config.chat_template)
        generation_config = load_generation_config(model_dir)
        eos_token_ids = _eos_token_ids(generation_config, arch, tokenizer)
        self.engine_core = EngineCore(self.resolved, tokenizer, eos_token_ids, replica or 0)
        self.model_info = ModelInfo(arch.architecture, tokenizer, self.resolved.max_model_len, arch.vocab_size,
                                    eos_token_ids, config.cache_config.block_size, generation_config,
                                    self.resolved.runner, self.resolved.pooler_config, arch.hidden_size,
                                    arch.encoder is not None, image_prompt(arch, model_dir, tokenizer),
                                    config.model_config.max_images_per_prompt, adapter_limits(config, arch))
        self.processor = Processor(self.model_info, self.engine_core.structured_output)
        self.output_processor = OutputProcessor(tokenizer)

    def shutdown(self) -> None:
        """Stop the worker processes, if any (they also stop when the engine is collected)."""
        self.engine_core.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        return self.model_info.default_sampling_params()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queue one prompt (n samples of it; PoolingParams: its embedding), with ``lora_request``'s
        adapter if given; raises InvalidRequest (a ValueError), and queues nothing, if it is
        invalid or can never fit. A constrained one waits here for its grammar to compile (no
        deadline: the caller's own constraint; a server bounds it, see AsyncLLMEngine)."""
        request = self.processor.process(request_id, prompt, params, priority, lora_request)
        if request.compilation is not None:
            try:
                request.compilation.future.result()  # its InvalidRequest, if it did not compile
            finally:
                self.processor.grammars.release(request.compilation)
        self.add_processed(request)

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
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one step; returns an output for each prompt that has one to give under its
        output kind (its ``finished`` flag says whether all its samples are done)."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput | PoolingRequestOutput], IterationStats]:
        """step(), plus what the step generated per prompt, for metrics whatever the output kind."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        self.engine_core.finish_step(processed.reqs_to_finish)
        return processed.request_outputs, processed.iteration_stats

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()


def adapter_limits(config: EngineConfig, arch: ArchConfig) -> AdapterLimits | None:
    """What adapters must fit, where the engine serves them."""
    lora = config.lora_config
    return AdapterLimits.of(arch, lora.max_lora_rank) if lora.enable_lora else None


def _eos_token_ids(generation_config: dict[str, Any], arch: ArchConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """generation_config's eos ids (config.json's when it has none), plus the tokenizer's eos."""
    gen_eos = generation_config.get("eos_token_id", list(arch.eos_token_ids))
    ids = set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
