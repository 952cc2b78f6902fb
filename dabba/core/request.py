"""A request as the scheduler sees it: token ids, progress, and its full-block hashes."""
from __future__ import annotations

import enum
import hashlib
import itertools
import time
from array import array
from dataclasses import dataclass, field

from dabba.core.multimodal import MultiModalFeature
from dabba.lora_request import LoRARequest
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # it could not go on (Request.error says why)

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


BlockHash = bytes
_arrival_counter = itertools.count()


def hash_block(parent: BlockHash | None, token_ids: list[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """Chained hash of one full block: equal hashes mean equal whole prefixes, not just equal blocks.
    ``extra_keys``: the identifiers of the images whose tokens the block holds (their placeholder
    ids are equal whatever the image)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\0" + key.encode())
    return h.digest()[:16]


@dataclass(eq=False)
class Request:
    """One sequence in flight.

    Token layout (``all_token_ids = prompt_token_ids + output_token_ids``)::

        | computed (KV in cache)  | to compute    | not yet known |
        0              num_computed_tokens    num_tokens

    A decode step computes the one token sampled last step, whose KV is not yet cached.

    A pooling request (``pooling_params``) computes its prompt and ends with its embedding: it
    samples nothing (its sampling_params are a placeholder of max_tokens 1, as vLLM's).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    block_size: int = 16
    pooling_params: PoolingParams | None = None
    # every prompt token is computed here, none served by the prefix cache: its pooling reads every
    # token's hidden state (MEAN, CLS), or an encoder, which keeps no KV
    computes_whole_prompt: bool = False
    one_step_prompt: bool = False  # its prompt runs in one step, never chunked (an encoder attends to all of it)
    token_type_ids: list[int] | None = None  # a cross-encoder's text pair: 1 in the second text
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images, in prompt order
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that ended it (stop strings are the engine's)
    error: str | None = None  # why it ended with FINISHED_ERROR, for the caller
    block_hashes: list[BlockHash] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens for its next step (never in all_token_ids)
    spec_accepted: int = 0  # its drafts accepted so far, and steps where one was rejected (core/spec_budget.py)
    spec_rejected: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefix_block_hashes(self) -> list[BlockHash]:
        """The full blocks a prefix cache may serve: never the one holding the last token, which
        must be computed to give the logits of the next."""
        return self.block_hashes[:(self.num_tokens - 1) // self.block_size]

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether cached blocks may serve its prompt: not where every prompt position's hidden
        state is needed (prompt logprobs, mean or first-token pooling)."""
        return self.sampling_params.prompt_logprobs is None and not self.computes_whole_prompt

    @property
    def use_structured_output(self) -> bool:
        """Its tokens go through the structured-output manager's mask (a constraint, or a thinking budget)."""
        return self.sampling_params.masked

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None, "engine fills max_tokens on add"
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every block that became full; hashes only ever grow (tokens never change)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            keys = tuple(f.identifier for f in self.mm_features if f.position.overlaps(i * bs, (i + 1) * bs))
            if i == 0 and self.lora is not None:  # the chain starts apart from the base model's and other adapters'
                keys += (f"lora:{self.lora.identity}",)
            self.block_hashes.append(hash_block(parent, self.all_token_ids[i * bs:(i + 1) * bs], keys))

    def sort_key(self) -> tuple[int, int]:
        """Lower is served first: priority value, then arrival order (FCFS)."""
        return (self.priority, self.arrival_seq)
