"""What crosses out of core/: SchedulerOutput and ModelRunnerOutput between core/ and worker/, and
EngineCoreOutputs from core/ to engine/. Plain data only, so each side could run in its own process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dabba.core.kv_offload import KVTransfers
from dabba.core.multimodal import MultiModalFeature
from dabba.lora_request import LoRARequest
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the output processor reads this module and never the scheduler's requests)
    from dabba.core.request import Request


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (sent whole again)."""

    request_id: str
    token_ids: list[int]  # prompt + any output so far
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # its table in each KV-cache group
    num_computed_tokens: int  # prefix-cache hit
    num_output_tokens: int  # where output starts in token_ids (seeded sampling is keyed on it)
    eos_token_ids: frozenset[int] = frozenset()  # banned with the stop tokens before min_tokens
    pooling_params: PoolingParams | None = None  # a pooling request: pooled when its prompt is done, never sampled
    token_type_ids: list[int] | None = None  # a cross-encoder's text pair (per prompt token)
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images (with their encoder inputs)
    lora: LoRARequest | None = None  # its adapter; None: the base model

    @classmethod
    def of(cls, request: Request, block_ids: tuple[list[int], ...], num_computed_tokens: int) -> "NewRequestData":
        return cls(request.request_id, list(request.all_token_ids), request.sampling_params, block_ids,
                   num_computed_tokens, request.num_output_tokens, request.eos_token_ids, request.pooling_params,
                   request.token_type_ids, request.mm_features, request.lora)


@dataclass
class CachedRequestData:
    """A request the worker holds; it already appended every token it sampled."""

    request_id: str
    new_block_ids: tuple[list[int], ...]  # appended to its table in each KV-cache group
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted
    # Requests that sample this step under structured_outputs, and for each a row of the bitmask
    # of the tokens their grammars allow ([rows, ceil(vocab / 32)] int32, a numpy array).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: the draft tokens a request's scheduled tokens end with (its last known
    # token comes first, then these); the step verifies them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The most draft tokens each scheduled request may propose for its next step (adaptive drafts,
    # core/spec_budget.py); a request missing here may propose num_speculative_tokens.
    spec_token_budget: dict[str, int] = field(default_factory=dict)
    # Images whose encodings start this step (by the request that starts them), and the
    # identifiers of encoder-cache entries (or encodings under way) to drop first
    # (core/encoder_cache.py). ``encoder_work``: the operations of the units of encoding
    # (models/encoder_steps.py) the worker may run this step on the encodings under way, oldest
    # first, before the forward (one unit at least; 0: none); None: every encoding to its end (the
    # images' tokens may then run in this step)
    scheduled_encoder_inputs: dict[str, list[MultiModalFeature]] = field(default_factory=dict)
    free_encoder_hashes: list[str] = field(default_factory=list)
    encoder_work: float | None = None
    # Copies between the pool and the host tier under it, before the forward (core/kv_offload.py)
    kv_transfers: KVTransfers | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position, from the model's raw distribution: the chosen (or
    prompt) token first, then the top N; ``rank`` is the chosen token's (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    """The tokens of each request that reached the end of its known tokens this step: one, or
    with draft tokens the accepted ones and the token after them; logprobs one per token."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request -> (position of the first prompt token covered, one entry per covered prompt token)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: draft tokens proposed for each request's next step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # and the proposer's time for them, in passes of one draft per request (a draft model's forwards):
    # adaptive drafts price a pass by it (core/spec_budget.py)
    draft_passes: int = 0
    draft_seconds: float = 0.0
    # Pooling requests whose whole input went through this step: their embeddings
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Images whose encodings ended this step (their tokens may run from the next), and the units of
    # encoding the step ran, their operations and time (core/image_budget.py prices them by it)
    encoded_images: list[str] = field(default_factory=list)
    encoder_units: int = 0
    encoder_work: float = 0.0
    encoder_seconds: float = 0.0
    # The disk tier's reads that ended since the last step: into the memory tier, or failed
    kv_fetched: list = field(default_factory=list)
    kv_fetch_failed: list = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one request got this step (core -> engine): only what is new, never the whole request.
    A prefill chunk that sampled nothing appears only when it brought prompt logprobs."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | None = None  # the stop token id that ended it; None for eos, length or running
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the worker computed them
    # (position of the first prompt token covered, one entry per covered prompt token), as in ModelRunnerOutput
    new_prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first scheduling
    error: str | None = None  # with finish_reason "error": why, in words for the caller
    pooling_output: list[float] | None = None  # a pooling request's embedding (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """One step's outputs, in the step's batch order."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
