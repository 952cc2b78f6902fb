"""The front end's half of adding a request (vLLM v1's Processor): tokenize, validate, apply the
model's defaults and fan n samples out into core requests, on the caller's thread, so that the
engine thread only queues what is already known to be valid."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dabba.core.multimodal import MultiModalFeature
from dabba.core.request import Request
from dabba.engine.model_info import ModelInfo
from dabba.engine.prompt_images import prompt_images
from dabba.errors import InvalidRequest
from dabba.lora_request import LoRARequest
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import RequestOutputKind, SamplingParams
from dabba.structured_output.compile_pool import Compilation
from dabba.structured_output.manager import StructuredOutputManager

PromptType = str | dict[str, Any]


@dataclass
class EngineRequest:
    """One prompt, processed: what the engine thread adds. Its ``params.n`` samples are core
    requests of their own (``samples``), sharing the prompt's full blocks through the prefix cache."""

    request_id: str
    prompt: str | None  # the text, when the caller gave one
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # with the engine's defaults applied (max_tokens)
    priority: int
    samples: list[Request]
    # its constraint's compile, claimed: the caller waits for it to finish, then releases it
    compilation: Compilation | None = None


class Processor:
    """Turns (request id, prompt, params, priority, adapter) into an EngineRequest or an
    InvalidRequest. Thread-safe: it reads ModelInfo, claims constraints' compiles, which are
    shared (a constraint starts compiling here, in a worker process, while its caller waits), and
    adds to a set the adapters it has checked."""

    def __init__(self, model_info: ModelInfo, grammars: StructuredOutputManager) -> None:
        self.model_info = model_info
        self.grammars = grammars
        self._checked_loras: set[LoRARequest] = set()  # adapters read and found to fit the model

    @staticmethod
    def needs_work(prompt: PromptType, params: SamplingParams | PoolingParams) -> bool:
        """Whether processing tokenizes or claims a compile, which may start a compiler process (an
        async caller then processes off its event loop): a prompt given as token ids without a
        constraint (or images, which take their preprocessing) is checked in no time."""
        constrained = isinstance(params, SamplingParams) and params.structured_outputs is not None
        plain_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt and "multi_modal_data" not in prompt
        return constrained or not plain_ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                priority: int = 0, lora_request: LoRARequest | None = None) -> EngineRequest:
        info = self.model_info
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise InvalidRequest("priority", f"priority must be an integer in [-2**63, 2**63), got {priority!r}")
        if lora_request is not None:
            self._check_lora(lora_request)
            if isinstance(params, PoolingParams):
                raise InvalidRequest("lora_request", "embedding requests run on the base model only")
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, priority)
        if info.runner == "pooling":
            raise InvalidRequest(None, "this model is served as a pooler (runner 'pooling'): it embeds and does "
                                       "not generate")
        params.check_vocab(info.vocab_size)
        text, token_ids, features = self._parse_image_prompt(prompt)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(info.max_model_len - len(token_ids), 1))
        samples: list[Request] = []
        for i in range(params.n):
            sample_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            samples.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=sample_params,
                eos_token_ids=info.eos_token_ids,
                priority=priority,
                block_size=info.block_size,
                mm_features=features,
                lora=lora_request,
                block_hashes=list(samples[0].block_hashes) if samples else [],  # the prompt's, hashed once
            ))
        compilation = None
        if params.structured_outputs is not None:  # compiling from now: last, so nothing after it fails
            compilation = self.grammars.compile(params.structured_outputs)
        return EngineRequest(request_id, text, token_ids, params, priority, samples, compilation)

    def _check_lora(self, lora: LoRARequest) -> None:
        """The adapter read and held against the model once per LoRARequest (the worker reads it
        again when it takes a slot): a request for one that cannot run is refused here."""
        if not isinstance(lora, LoRARequest):
            raise InvalidRequest("lora_request", f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        limits = self.model_info.lora
        if limits is None:
            raise InvalidRequest("lora_request", "this engine serves no LoRA adapters (start it with enable_lora)")
        if lora in self._checked_loras:
            return
        try:
            limits.read(lora.lora_path)
        except ValueError as e:
            raise InvalidRequest("lora_request", str(e)) from None
        self._checked_loras.add(lora)

    def _process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                         priority: int) -> EngineRequest:
        """An embedding request: the model's default prompt before a text input (sentence-
        transformers' default_prompt_name), truncated to its last ``truncate_prompt_tokens``."""
        info, pooler = self.model_info, self.model_info.pooler
        if pooler is None:
            raise InvalidRequest(None, f"this model ({info.architecture}) does not embed")
        if params.dimensions is not None and not pooler.matryoshka:
            raise InvalidRequest("dimensions", "dimensions: this model is not a Matryoshka model (its config.json "
                                               "has no is_matryoshka or matryoshka_dimensions); it gives its full "
                                               f"{info.hidden_size} values")
        if params.dimensions is not None and params.dimensions > info.hidden_size:
            raise InvalidRequest("dimensions", f"dimensions must be at most the model's {info.hidden_size}, got "
                                               f"{params.dimensions}")
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise InvalidRequest("multi_modal_data", "embedding requests take text only here, no images")
        if pooler.prompt and isinstance(prompt, str):
            prompt = pooler.prompt + prompt
        text, token_ids = self._parse_prompt(prompt)
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if pooler.task == "score" and types is None:
            raise InvalidRequest("prompt", "this model is a cross-encoder: it scores text pairs (score, rerank) and "
                                           "does not embed")
        if types is not None and (not isinstance(types, list) or len(types) != len(token_ids)
                                  or any(t not in (0, 1) for t in types)):
            raise InvalidRequest("token_type_ids", "token_type_ids must be 0 or 1 for each of prompt_token_ids")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = info.max_model_len if keep == -1 else keep
            token_ids, types = token_ids[-keep:], None if types is None else types[-keep:]
        if not token_ids:
            raise InvalidRequest("prompt", "the input must contain at least one token")
        sample = Request(request_id=request_id, prompt_token_ids=token_ids,
                         sampling_params=SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY),
                         priority=priority, block_size=info.block_size, pooling_params=params,
                         computes_whole_prompt=pooler.needs_all_tokens or info.encoder, one_step_prompt=info.encoder,
                         token_type_ids=types)
        return EngineRequest(request_id, text, token_ids, params, priority, [sample])

    def _parse_image_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """_parse_prompt's text and ids, and the prompt's images (multi_modal_data), each image's
        mark grown into the model's image sequence."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return *self._parse_prompt(prompt), []
        info = self.model_info
        images = prompt_images(data)
        if images and info.image_prompt is None:
            raise InvalidRequest("multi_modal_data", f"this model ({info.architecture}) takes no images")
        if len(images) > info.max_images_per_prompt:
            raise InvalidRequest("multi_modal_data", f"{len(images)} images in one prompt; at most "
                                                     f"{info.max_images_per_prompt} (limit_mm_per_prompt)")
        if not images:
            return *self._parse_prompt(prompt), []
        if "prompt_token_ids" in prompt:
            text, token_ids = self._parse_prompt(prompt)
            token_ids = info.image_prompt.expand_ids(token_ids, images)
        else:
            text = prompt.get("prompt")
            if not isinstance(text, str):
                raise InvalidRequest("prompt", "a prompt with images must be {'prompt': str} or "
                                               "{'prompt_token_ids': [int, ...]}, with its multi_modal_data")
            token_ids = info.tokenizer.encode(info.image_prompt.expand_text(text, images))
        return text, token_ids, info.image_prompt.features(token_ids, images)

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        tokenizer, vocab_size = self.model_info.tokenizer, self.model_info.vocab_size
        if isinstance(prompt, str):
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequest("prompt_token_ids", "prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest("prompt_token_ids",
                                     f"prompt_token_ids contains ids outside [0, {vocab_size}): {bad[:5]}")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise InvalidRequest("prompt", "prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")
