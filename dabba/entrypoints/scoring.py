"""Scoring text pairs, shared by LLM.score / LLM.rerank and the server's /score and /rerank: a
cross-encoder reads each pair whole (its tokenizer's pair template, token types, or a prompt of
its own: Qwen3-Reranker's, with an instruction) and its logit through a sigmoid is the score
(sentence-transformers' CrossEncoder, vLLM); an embedding model
embeds each text and the score is the two embeddings' cosine similarity (vLLM's score on
embedding models)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dabba.engine.model_info import ModelInfo
from dabba.errors import InvalidRequest


@dataclass(frozen=True)
class ScoringPlan:
    """What to run for a list of pairs: ``prompts`` (one per pair for a cross-encoder, two per pair
    for an embedding model: each pair's texts in turn)."""

    prompts: list[dict[str, Any] | str]
    cross_encoder: bool

    def scores(self, vectors: list[list[float]]) -> list[float]:
        """The pooled outputs of ``prompts``, in order -> one score per pair."""
        if self.cross_encoder:
            return [_sigmoid(v[0]) for v in vectors]
        return [_cosine(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]


def pair_up(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of a list, or two lists of equal length pairwise."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise InvalidRequest("text_1" if not firsts else "text_2", "text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidRequest("text_2", f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                                       "or as many as text_2")
    return list(zip(firsts, seconds))


def plan_scoring(info: ModelInfo, pairs: list[tuple[str, str]], instruction: str | None = None) -> ScoringPlan:
    """``instruction``: what a reranker with a prompt of its own is told to judge by (its default
    where None)."""
    pooler = info.pooler
    if pooler is None:
        raise InvalidRequest(None, f"this model ({info.architecture}) neither embeds nor scores text pairs")
    if instruction is not None and not pooler.pair_template:
        raise InvalidRequest("instruction", f"this model ({info.architecture}) reads no instruction: only a reranker "
                                            "with a judging prompt (Qwen3-Reranker) does")
    if pooler.task == "score":
        told = pooler.instruction if instruction is None else instruction
        prompts: list[dict[str, Any] | str] = []
        for first, second in pairs:
            if pooler.pair_template:  # the pair inside the judging prompt: one segment
                ids = info.tokenizer.encode(pooler.pair_template.format(instruction=told, query=first, document=second))
                types = [0] * len(ids)
            else:
                ids, types = info.tokenizer.encode_pair(first, second)
            prompts.append({"prompt_token_ids": ids, "token_type_ids": types})
        return ScoringPlan(prompts, True)
    return ScoringPlan([text for pair in pairs for text in pair], False)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    norm = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norm if norm else 0.0
