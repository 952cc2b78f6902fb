"""Embeddings and scores under tensor parallelism (worker processes): each rank holds a share of
the decoder's heads, MLP and vocabulary, and the pooled vectors (a decoder's last token, BERT's
CLS, ModernBERT's mean, a cross-encoder's classifier, Qwen3-Reranker's head made from the tied
embedding's rows) equal one rank's."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM
from tools.embedding_checkpoints import embedding_checkpoint, encoder_checkpoint

TEXTS = ["Return the list sorted.", "a", "Decode a JSON document from s and return a Python object, " * 3]
DOCS = ["Decode a JSON document.", "hello", "Return a new sorted list."]


def _pooled(llm: LLM, score: bool) -> torch.Tensor:
    if score:
        return torch.tensor([o.outputs.score for o in llm.score("what does json do", DOCS, use_tqdm=False)])
    return torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


@pytest.mark.parametrize("kind", ["decoder", "encoder", "modernbert", "cross-encoder", "reranker"])
def test_pooled_outputs_equal_one_rank(kind, tmp_path) -> None:
    options: dict = dict(dtype="float32", max_num_batched_tokens=256)
    if kind == "reranker":
        from tests.test_scoring import QWEN3_RERANKER_OVERRIDES, _original_qwen3_reranker

        _original_qwen3_reranker(tmp_path / "m")
        path, options["hf_overrides"] = tmp_path / "m", QWEN3_RERANKER_OVERRIDES
    elif kind == "decoder":
        path = embedding_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", "LAST")
    elif kind == "modernbert":
        path = encoder_checkpoint(tmp_path / "m", "ModernBertModel", "MEAN")
    else:
        arch = "BertModel" if kind == "encoder" else "BertForSequenceClassification"
        path = encoder_checkpoint(tmp_path / "m", arch, "CLS" if kind == "encoder" else None)
    score = kind in ("cross-encoder", "reranker")
    whole = _pooled(LLM(str(path), **options), score)
    split = LLM(str(path), tensor_parallel_size=2, **options)
    try:
        torch.testing.assert_close(_pooled(split, score), whole, rtol=1e-5, atol=1e-5)
    finally:
        split.llm_engine.shutdown()
