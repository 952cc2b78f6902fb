"""What callers get back: one RequestOutput per prompt, one CompletionOutput per sample; a pooling
request's PoolingRequestOutput, its embedding."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float  # from the model's raw distribution (before temperature and penalties)
    rank: int  # 1 = the most likely token
    decoded_token: str


# One position: token id -> Logprob, holding the chosen (or prompt) token and the top N.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (eos, a stop token or string), "length", "abort", "error" (``error`` says why); None while running
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for eos/length
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when asked
    cumulative_logprob: float | None = None
    error: str | None = None  # why it ended with finish_reason "error" (its grammar reached a dead end)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # None for the first prompt token


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's EmbeddingRequestOutput): it comes when the whole
    input went through, finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's sigmoid of its logit, or the two embeddings' cosine similarity


@dataclass
class ScoringRequestOutput:
    """One text pair's score (vLLM's ScoringRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]  # the pair's tokens (an embedding model's: the two texts', one after the other)
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class RerankResult:
    index: int  # the document's place in the request
    document: str
    relevance_score: float
