"""Embeddings from decoder families (Qwen3-Embedding / gte-Qwen2 style), against
sentence-transformers reading the same tiny random checkpoint (float32): last-token and mean
pooling, normalised or not, inputs of mixed lengths in one batch, chunked through a small token
budget, beside generation requests on a generating model, and Matryoshka dimensions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dabba import LLM, SamplingParams
from dabba.pooling_params import PoolingParams
from tools.embedding_checkpoints import embedding_checkpoint

TEXTS = ["hello", "Return a new list containing all items from the iterable in ascending order.",
         "json", "Decode a JSON document from s (a str beginning with a JSON document) and return a 2-tuple of the "
         "Python representation and the index in s where the document ended. This can be used to decode a JSON "
         "document from a string that may have extraneous data at the end."]
MIN_COSINE = 0.99999


def reference(path, texts: list[str], **encode) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_tensor=True, **encode).float()


def assert_close(ours: list[list[float]], theirs: torch.Tensor) -> None:
    ours_t = torch.tensor(ours)
    assert ours_t.shape == theirs.shape
    cosine = F.cosine_similarity(ours_t, theirs, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    torch.testing.assert_close(ours_t.norm(dim=-1), theirs.norm(dim=-1), rtol=1e-4, atol=1e-5)


def vectors(outputs) -> list[list[float]]:
    return [o.outputs.embedding for o in outputs]


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """Qwen3-Embedding's layout: Qwen3ForCausalLM in config.json, the base model's tensors without
    the model. prefix, last-token pooling, normalised, Matryoshka."""
    return embedding_checkpoint(tmp_path_factory.mktemp("qwen3emb") / "m", "Qwen3ForCausalLM", "LAST",
                                matryoshka=True, head_dim=32, initializer_range=0.1)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory):
    """A base LlamaModel with mean pooling and no Normalize module."""
    return embedding_checkpoint(tmp_path_factory.mktemp("llamamean") / "m", "LlamaForCausalLM", "MEAN",
                                normalize=False, architecture="LlamaModel", strip_prefix=False, initializer_range=0.1)


@pytest.mark.parametrize("budget", [256, 16])  # 16: every long input is cut into chunks
def test_last_token_embeddings_equal_sentence_transformers(qwen3_embedding, budget) -> None:
    llm = LLM(str(qwen3_embedding), dtype="float32", max_num_batched_tokens=budget, max_num_seqs=4)
    assert llm.llm_engine.model_info.runner == "pooling"
    assert_close(vectors(llm.embed(TEXTS)), reference(qwen3_embedding, TEXTS))
    ids = [[5, 9, 31, 7], list(range(3, 40))]
    out = llm.embed([{"prompt_token_ids": p} for p in ids])
    assert [o.prompt_token_ids for o in out] == ids


@pytest.mark.parametrize("budget", [256, 16])
def test_mean_pooling_equals_sentence_transformers(llama_mean, budget) -> None:
    llm = LLM(str(llama_mean), dtype="float32", max_num_batched_tokens=budget)
    assert_close(vectors(llm.embed(TEXTS)), reference(llama_mean, TEXTS))
    again = vectors(llm.embed(TEXTS))  # the prefix cache holds their blocks now: mean pooling must not use it
    assert_close(again, reference(llama_mean, TEXTS))


def test_dimensions_on_a_matryoshka_model(qwen3_embedding, llama_mean) -> None:
    llm = LLM(str(qwen3_embedding), dtype="float32")
    full = reference(qwen3_embedding, TEXTS)
    cut = F.normalize(full[:, :32], dim=-1)  # Matryoshka: the prefix, normalised again (vLLM's order)
    assert_close(vectors(llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=32))), cut)
    raw = torch.tensor(vectors(llm.embed(TEXTS, pooling_params=PoolingParams(normalize=False))))
    assert ((raw.norm(dim=-1) - 1).abs() > 1e-2).all()  # not normalised, and the same direction
    assert_close(F.normalize(raw, dim=-1).tolist(), full)
    with pytest.raises(ValueError, match="dimensions"):
        LLM(str(llama_mean), dtype="float32").embed("x", pooling_params=PoolingParams(dimensions=8))


def test_embeddings_beside_generation_on_a_generating_model(checkpoints) -> None:
    """A chat model embeds too (its last hidden state, normalised): in one batch with generation,
    neither changes the other."""
    llm = LLM(str(checkpoints["qwen3"].path), dtype="float32", max_num_batched_tokens=32)
    assert llm.llm_engine.model_info.runner == "generate"
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in checkpoints["qwen3"].prompts[2:6]]
    alone_text = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    alone_vectors = vectors(llm.embed(TEXTS))
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, greedy)
    for i, text in enumerate(TEXTS):
        engine.add_request(f"e{i}", text, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(len(prompts))] == alone_text
    mixed = [done[f"e{i}"].outputs.embedding for i in range(len(TEXTS))]
    torch.testing.assert_close(torch.tensor(mixed), torch.tensor(alone_vectors), rtol=1e-5, atol=1e-6)
    hidden_last = reference_last_hidden(checkpoints["qwen3"].path, llm, TEXTS[1])
    assert F.cosine_similarity(torch.tensor(alone_vectors[1]), hidden_last, dim=0) >= MIN_COSINE


def reference_last_hidden(path, llm: LLM, text: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    ids = llm.llm_engine.model_info.tokenizer.encode(text)
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def test_bad_embedding_requests(qwen3_embedding) -> None:
    llm = LLM(str(qwen3_embedding), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="at least one token"):
        llm.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.embed({"prompt_token_ids": [10**6]})
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": list(range(3, 80))})
    out = llm.embed({"prompt_token_ids": list(range(3, 80))}, truncate_prompt_tokens=64)
    assert out[0].prompt_token_ids == list(range(16, 80))  # the last 64, as vLLM keeps them
    with pytest.raises(ValueError, match="generate"):
        llm.generate("hello", SamplingParams(max_tokens=2))


def test_the_checkpoint_says_how_it_pools(tmp_path, llama_mean) -> None:
    """sentence-transformers' files, read defensively: what we cannot pool as it says is refused by name."""
    import json
    import shutil

    from dabba.arch.pooling_config import read_pooler_config

    config = read_pooler_config(llama_mean, {})
    assert (config.pooling_type, config.normalize, config.matryoshka, config.prompt) == ("MEAN", False, False, "")
    assert read_pooler_config(llama_mean, {"is_matryoshka": True}, "cls").pooling_type == "CLS"
    path = shutil.copytree(llama_mean, tmp_path / "m")
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    assert read_pooler_config(path, {}).prompt == "query: "
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling modes"):
        read_pooler_config(path, {})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    modules = json.loads((path / "modules.json").read_text())
    dense = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (path / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ValueError, match="Dense"):
        read_pooler_config(path, {})
    (path / "modules.json").write_text(json.dumps([{**modules[1], "path": "../elsewhere"}]))
    with pytest.raises(ValueError, match="inside the checkpoint"):
        read_pooler_config(path, {})
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(str(llama_mean), runner="generate")


# ---- BERT-style encoders ------------------------------------------------------------------------

@pytest.mark.parametrize("arch, pooling, tokenizer", [("BertModel", "CLS", "byte-level"),
                                                     ("BertModel", "MEAN", "wordpiece"),
                                                     ("XLMRobertaModel", "MEAN", "byte-level"),
                                                     ("ModernBertModel", "MEAN", "byte-level")])
def test_encoder_embeddings_equal_sentence_transformers(arch, pooling, tokenizer, tmp_path) -> None:
    """Bidirectional attention within each input, no KV kept, every input whole in its step; BERT
    with its own WordPiece tokenizer too."""
    from tools.embedding_checkpoints import encoder_checkpoint

    path = encoder_checkpoint(tmp_path / "m", arch, pooling, tokenizer=tokenizer)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=128, max_num_seqs=8)
    assert llm.llm_engine.model_info.runner == "pooling" and llm.llm_engine.model_info.encoder
    assert_close(vectors(llm.embed(TEXTS * 3)), reference(path, TEXTS * 3))  # more tokens than one step takes
    stats = llm.get_stats()
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    out = llm.embed({"prompt_token_ids": list(range(3, 300))}, truncate_prompt_tokens=100)
    assert out[0].prompt_token_ids == list(range(200, 300))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # an input cannot be split
        LLM(str(path), dtype="float32", max_num_batched_tokens=16).embed(TEXTS[1])
    with pytest.raises(ValueError, match="encoder"):
        LLM(str(path), runner="generate")


@pytest.mark.parametrize("kind, quantization", [("decoder", None), ("encoder", None), ("encoder", "w8a8")])
def test_bf16_embeddings_stay_close_to_float32(kind, quantization, qwen3_embedding, tmp_path) -> None:
    """bf16 weights and activations: within a cosine of 0.999 of sentence-transformers' float32
    vectors on these tiny random checkpoints (bf16 keeps 8 bits of mantissa; a layer's rounding
    moves a unit vector by about 2**-8 relative); an encoder's linears in W8A8 too (int8 weights
    per channel, activations rounded to int8 per token: about 2**-7 relative)."""
    from tools.embedding_checkpoints import encoder_checkpoint

    path = qwen3_embedding if kind == "decoder" else encoder_checkpoint(tmp_path / "m", "BertModel", "MEAN")
    ours = torch.tensor(vectors(LLM(str(path), dtype="bfloat16", quantization=quantization).embed(TEXTS)))
    cosine = F.cosine_similarity(ours, reference(path, TEXTS), dim=-1)
    assert cosine.min().item() >= 0.999, cosine
