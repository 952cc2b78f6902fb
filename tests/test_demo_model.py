"""The bundled demo model: what the package ships, that transformers reads it the same way,
that it writes words of its corpus rather than noise, and that a chat gets a short answer."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import build_parser

DEMO = Path(DEMO_MODEL)
PROMPTS = ["The json module", "A list is", "To open a file,"]


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(DEMO_MODEL, dtype="float32")


def test_shipped_files() -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "heldout.txt", "calibration.txt", "DATA_LICENSE.txt", "loss.png",
                 "training_args.json", "samples.json"):
        assert (DEMO / name).is_file(), name
    assert sum(f.stat().st_size for f in DEMO.iterdir()) < 40 * 2**20
    config = json.loads((DEMO / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    from safetensors import safe_open

    with safe_open(str(DEMO / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert 100_000 < (DEMO / "heldout.txt").stat().st_size < 1_000_000
    assert (DEMO / "calibration.txt").stat().st_size > 50_000
    template = json.loads((DEMO / "tokenizer_config.json").read_text())["chat_template"]
    assert template == (DEMO / "chat_template.jinja").read_text() and "<|assistant|>" in template


def test_transformers_reads_it_the_same_way(demo) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEMO)
    outs = demo.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref


def test_it_writes_words_of_its_corpus(demo) -> None:
    vocabulary = set(re.findall(r"[a-z]+", (DEMO / "calibration.txt").read_text().lower()))
    outs = demo.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    words = [w for o in outs for w in re.findall(r"[A-Za-z]+", o.outputs[0].text)]
    assert len(words) >= 30
    known = sum(w.lower() in vocabulary for w in words) / len(words)
    assert known > 0.9, f"only {known:.0%} of the generated words occur in the corpus: {words}"


def test_a_chat_gets_a_short_answer_on_its_topic(demo) -> None:
    """The instruction stage taught it to answer and stop: each sample question's greedy reply
    ends with <|end|> well before the limit, and most share a word with their question (the
    previous model ran on to the limit with fragments of documentation)."""
    from tools.train_demo_model.__main__ import SAMPLE_QUESTIONS

    tok = demo.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in SAMPLE_QUESTIONS]
    outs = demo.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    on_topic = 0
    for question, out in zip(SAMPLE_QUESTIONS, outs):
        reply = out.outputs[0]
        assert reply.finish_reason == "stop" and len(reply.token_ids) <= 40, (question, reply.text)
        topic = set(re.findall(r"[a-z]{4,}", question.lower())) - {"what", "does"}
        on_topic += bool(topic & set(re.findall(r"[a-z]{4,}", reply.text.lower())))
    assert on_topic >= 4, [o.outputs[0].text for o in outs]


def test_it_is_the_default_model() -> None:
    parser = build_parser()
    for command in (["serve"], ["chat"], ["generate", "--prompt", "x"]):
        assert parser.parse_args(command).model == DEMO_MODEL
