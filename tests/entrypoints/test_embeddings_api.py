"""POST /v1/embeddings against a live server, with the official openai client (floats and base64,
which the client decodes itself), equal to the Python API's vectors; the 400s naming the field."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from dabba import LLM
from dabba.entrypoints.openai.serving_embedding import MAX_EMBEDDING_INPUTS

from tests.entrypoints.live_server import live_server
from tools.embedding_checkpoints import embedding_checkpoint

MODEL = "emb"
TEXTS = ["hello world", "Return a new list containing all items from the iterable in ascending order."]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return embedding_checkpoint(tmp_path_factory.mktemp("emb") / "m", "Qwen3ForCausalLM", "LAST", matryoshka=True,
                                initializer_range=0.1)


@pytest.fixture(scope="module")
def server(path):
    with live_server(str(path), MODEL, None, max_model_len=64) as (url, _):
        yield url


@pytest.fixture(scope="module")
def expected(path) -> list[list[float]]:
    return [o.outputs.embedding for o in LLM(str(path), dtype="float32", max_model_len=64).embed(TEXTS)]


def test_the_openai_client_gets_the_python_apis_vectors(server, expected) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    # unasked, the client asks for base64 and decodes it itself; asked, it hands the text over
    for encoding in (openai.NOT_GIVEN, "float", "base64"):
        r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
        got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() if encoding == "base64"
               else d.embedding for d in r.data]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(expected[0]))
    cut = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16)
    vectors = torch.tensor([d.embedding for d in cut.data])
    torch.testing.assert_close(vectors, torch.nn.functional.normalize(torch.tensor(expected)[:, :16], dim=-1))


def test_token_id_inputs(server) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": [[5, 6, 7], [8, 9]]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    r1 = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": [5, 6, 7]})
    torch.testing.assert_close(torch.tensor(r1.json()["data"][0]["embedding"]),  # alone, or batched with another
                               torch.tensor(r.json()["data"][0]["embedding"]))


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ({"input": [[10**6]]}, "input"),
    ({"input": [list(range(3, 90))]}, "input"),  # over max_model_len, no truncation asked
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 10**4}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error


def test_truncation_and_what_a_pooler_cannot_do(server) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, "input": [list(range(3, 90))],
                                                     "truncate_prompt_tokens": 64})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "pooler" in r.json()["error"]["message"]


def test_dimensions_need_a_matryoshka_model(checkpoints) -> None:
    with live_server(str(checkpoints["qwen2"].path), MODEL, None) as (url, _):  # a generator embeds too
        r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hello"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 96
        r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "hello", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
