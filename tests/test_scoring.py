"""Scoring text pairs: cross-encoders (BERT with token types, XLM-R) against sentence-transformers'
CrossEncoder on the same tiny checkpoint, an embedding model's cosine similarity against its
embeddings, rerank's order, and the server's /score and /rerank (vLLM's and Jina/Cohere's shapes)."""
from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from dabba import LLM
from tests.entrypoints.live_server import live_server
from tools.embedding_checkpoints import embedding_checkpoint, encoder_checkpoint

QUERY = "what does json do"
DOCS = ["Decode a JSON document from s and return a Python object.", "hello",
        "Return a new list containing all items from the iterable in ascending order.", "json"]


@pytest.fixture(scope="module", params=["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
def cross_encoder(request, tmp_path_factory):
    return encoder_checkpoint(tmp_path_factory.mktemp("ce") / "m", request.param, pooling=None)


def crossencoder_reference(path, pairs) -> torch.Tensor:
    from sentence_transformers import CrossEncoder

    return torch.tensor(CrossEncoder(str(path), device="cpu").predict(pairs)).float()


def test_cross_encoder_scores_equal_sentence_transformers(cross_encoder) -> None:
    llm = LLM(str(cross_encoder), dtype="float32")
    assert llm.llm_engine.model_info.pooler.task == "score"
    expected = crossencoder_reference(cross_encoder, [(QUERY, d) for d in DOCS])
    scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS)])
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-4)
    pairwise = [o.outputs.score for o in llm.score(DOCS[:2], DOCS[2:])]  # two lists: pair by pair
    torch.testing.assert_close(torch.tensor(pairwise), crossencoder_reference(cross_encoder, list(zip(DOCS[:2],
                                                                                                      DOCS[2:]))),
                               rtol=0, atol=1e-4)
    ranked = llm.rerank(QUERY, DOCS, top_n=3)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:3]
    assert [r.index for r in ranked] == order and [r.document for r in ranked] == [DOCS[i] for i in order]
    with pytest.raises(ValueError, match="does not embed"):
        llm.embed(QUERY)
    with pytest.raises(ValueError, match="text_2"):
        llm.score(DOCS[:2], DOCS[:3])


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_modernbert_cross_encoder_pools_as_its_config_says(pooling, tmp_path) -> None:
    """ModernBERT's classifier reads the first token's state or the mean (classifier_pooling)."""
    path = encoder_checkpoint(tmp_path / "m", "ModernBertForSequenceClassification", pooling=None,
                              classifier_pooling=pooling)
    llm = LLM(str(path), dtype="float32")
    scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS)])
    torch.testing.assert_close(scores, crossencoder_reference(path, [(QUERY, d) for d in DOCS]), rtol=0, atol=1e-4)


def test_an_embedding_model_scores_by_cosine(tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    path = embedding_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", "LAST", initializer_range=0.1)
    llm = LLM(str(path), dtype="float32")
    vectors = SentenceTransformer(str(path), device="cpu").encode([QUERY, *DOCS], convert_to_tensor=True).float()
    expected = F.cosine_similarity(vectors[:1], vectors[1:], dim=-1)
    scores = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS)])
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-4)


def test_score_and_rerank_over_http(cross_encoder) -> None:
    llm = LLM(str(cross_encoder), dtype="float32")
    expected = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    with live_server(str(cross_encoder), "ce", None) as (url, _):
        for path in ("/v1/score", "/score"):
            r = httpx.post(f"{url}{path}", json={"model": "ce", "text_1": QUERY, "text_2": DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [d["index"] for d in body["data"]] == list(range(len(DOCS))) and body["object"] == "list"
            torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), torch.tensor(expected))
            assert body["usage"]["prompt_tokens"] > len(DOCS)
        order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = httpx.post(f"{url}{path}", json={"model": "ce", "query": QUERY, "top_n": 2,
                                                 "documents": [DOCS[0], *({"text": d} for d in DOCS[1:])]})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == order[:2]
            assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order[:2]]
        r = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": False})
        assert [x["index"] for x in r.json()["results"]] == order and "document" not in r.json()["results"][0]
        bad = [({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "/v1/score", "text_2"),
               ({"text_1": [], "text_2": "x"}, "/v1/score", "text_1"),
               ({"query": "q"}, "/v1/rerank", "documents"),
               ({"query": "q", "documents": ["d"], "instruction": "x"}, "/v1/rerank", "instruction"),
               ({"input": "x"}, "/v1/embeddings", "input")]  # a cross-encoder does not embed
        for body, path, param in bad:
            r = httpx.post(f"{url}{path}", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_a_decoder_reranker_scores_from_its_last_token(tmp_path) -> None:
    """Qwen3-Reranker's sequence-classification form (Qwen3ForSequenceClassification: a score head
    over the last token), against transformers on each pair; chunked through a small budget, and
    with the query's blocks shared through the prefix cache."""
    import transformers

    from tools.tiny_checkpoint import save_byte_level_tokenizer

    vocab = save_byte_level_tokenizer(tmp_path, 1024, "docstrings")
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1,
                                      max_position_embeddings=512,
                                      initializer_range=0.1, bos_token_id=0, eos_token_id=1)
    config.architectures = ["Qwen3ForSequenceClassification"]
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits)[0, 0].item() for d in DOCS]
    for budget in (256, 16):
        llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=budget)
        assert llm.llm_engine.model_info.runner == "pooling"
        scores = [o.outputs.score for o in llm.score(QUERY, DOCS)]
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=0, atol=1e-4)


def _original_qwen3_reranker(path) -> tuple[object, object]:
    """A tiny Qwen3ForCausalLM as Qwen3-Reranker ships (an LM head, no score head), its tokenizer
    given whole-word "yes" and "no" tokens as Qwen's vocabulary has; the model and tokenizer."""
    import transformers
    from tokenizers import AddedToken

    from tools.tiny_checkpoint import save_byte_level_tokenizer

    save_byte_level_tokenizer(path, 1024, "docstrings")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([AddedToken(t, single_word=True, normalized=False) for t in ("yes", "no")])
    tokenizer.save_pretrained(path)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.1,
                                      bos_token_id=0, eos_token_id=1)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model, tokenizer


QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def test_the_original_qwen3_reranker_scores_yes_against_no(tmp_path) -> None:
    """Qwen3-Reranker as released (a causal LM; vLLM's hf_overrides make it a reranker): each pair
    in the model's judging prompt, the score P("yes") of the two-way softmax over the "no" and
    "yes" logits at the last token, as its model card computes with transformers; with the
    default and a custom instruction, through a small budget (chunked) and over HTTP."""
    # the model card's prompt, written out here as it writes it
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    model, tokenizer = _original_qwen3_reranker(tmp_path)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")

    def expected(instruction: str) -> torch.Tensor:
        out = []
        for doc in DOCS:
            text = f"{prefix}<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {doc}{suffix}"
            with torch.no_grad():
                logits = model(**tokenizer(text, return_tensors="pt")).logits[0, -1]
            out.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
        return torch.tensor(out)

    default = expected("Given a web search query, retrieve relevant passages that answer the query")
    custom = expected("Find the docstring of a JSON function")
    for budget in (512, 16):
        llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=budget, hf_overrides=QWEN3_RERANKER_OVERRIDES)
        assert llm.llm_engine.model_info.runner == "pooling"
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS)]), default,
                                   rtol=0, atol=1e-4)
        ranked = llm.rerank(QUERY, DOCS, instruction="Find the docstring of a JSON function")
        by_index = sorted(ranked, key=lambda r: r.index)
        torch.testing.assert_close(torch.tensor([r.relevance_score for r in by_index]), custom, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="instruction"):  # a cross-encoder's pairs have no instruction to take
        one_token = {**QWEN3_RERANKER_OVERRIDES, "is_original_qwen3_reranker": False, "classifier_from_token": ["yes"]}
        LLM(str(tmp_path), dtype="float32", hf_overrides=one_token).score(QUERY, DOCS, instruction="x")
    with live_server(str(tmp_path), "rr", None, hf_overrides=QWEN3_RERANKER_OVERRIDES) as (url, _):
        r = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                                 "instruction": "Find the docstring of a JSON function"})
        assert r.status_code == 200, r.text
        scores = {item["index"]: item["relevance_score"] for item in r.json()["results"]}
        torch.testing.assert_close(torch.tensor([scores[i] for i in range(len(DOCS))]), custom, rtol=0, atol=1e-4)
        r = httpx.post(f"{url}/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        torch.testing.assert_close(torch.tensor([d["score"] for d in r.json()["data"]]), default, rtol=0, atol=1e-4)


def test_classifier_tokens_are_checked(tmp_path) -> None:
    _original_qwen3_reranker(tmp_path)
    for overrides, says in [({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["no", "maybe"]}, "maybe"),
                            ({**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["no", "yes", "no"]}, "one or two"),
                            ({"classifier_from_token": ["no", "yes"]}, "classifier_from_token"),
                            ({"architectures": "Qwen3ForCausalLM"}, "architectures")]:
        with pytest.raises(ValueError, match=says):
            LLM(str(tmp_path), dtype="float32", hf_overrides=overrides)
    with pytest.raises(ValueError, match="hf_overrides"):
        LLM(str(tmp_path), hf_overrides="[1]")
