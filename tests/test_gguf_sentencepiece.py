"""GGUF files whose vocabulary is SentencePiece (tokenizer.ggml.model "llama": Llama 2, Mistral, Phi-3,
Gemma): a tiny Llama with a SentencePiece tokenizer trained here (tools/tiny_checkpoint.py), converted
by llama.cpp's own convert_hf_to_gguf.py, tokenizes and decodes as transformers' tokenizer of the
source checkpoint does, with the dummy prefix space (Llama's) and without it (Gemma's), and
generates transformers' greedy tokens; SentencePiece metadata that does not make a vocabulary is a
ValueError naming the file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFWriter
from tokenizers import Tokenizer as HFTokenizer

from dabba import LLM, SamplingParams
from dabba.arch.gguf_file import read_gguf
from dabba.arch.gguf_tokenizer import tokenizer_json
from dabba.models.gguf_checkpoint import gguf_model_dir
from tests import test_gguf_models
from tests.conftest import INIT_STD, hf_greedy
from tools.tiny_checkpoint import make_checkpoint, train_sentencepiece

REPO = Path(__file__).resolve().parents[1]
llama_cpp = test_gguf_models.llama_cpp  # the converter; a skip where it is missing (a failure under CI)
TEXTS = (test_gguf_models.MULTILINGUAL, " leading space", "trailing  \n\n", "x</s>y <pad>z", "a<sep>b <sep> c",
         "four    spaces", "<unk>", "")
STYLES = ("llama", "gemma")  # with the dummy prefix space, without it
VOCAB = 1000


@pytest.fixture(scope="module")
def converted(llama_cpp, tmp_path_factory):
    """style -> (the source checkpoint, its F32 GGUF file), made once per module."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(style: str) -> tuple[Path, Path]:
        if style not in made:
            source = make_checkpoint(tmp_path_factory.mktemp(f"spm-{style}"), sentencepiece=style,
                                     tokenizer_vocab_size=VOCAB, initializer_range=INIT_STD)
            out = tmp_path_factory.mktemp(f"spm-gguf-{style}")
            result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "make_gguf.py"), "--model",
                                     str(source), "--llama-cpp-dir", str(llama_cpp), "--out-dir", str(out),
                                     "--types", "f32"], capture_output=True, text=True, cwd=REPO)
            assert result.returncode == 0, result.stderr[-3000:]
            made[style] = source, Path(json.loads(result.stdout)["f32"])
        return made[style]

    return get


def assert_same_tokenizer(ours: HFTokenizer, source) -> None:
    """Encodes each text to the same ids, with special tokens and without, and decodes ids back to
    the same text, special tokens skipped and kept."""
    for text in TEXTS:
        for special in (True, False):
            ids = source.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special).ids == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == source.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("style", STYLES)
def test_the_files_tokenizer_encodes_and_decodes_as_the_source_does(style, converted) -> None:
    from transformers import AutoTokenizer

    source, path = converted(style)
    f = read_gguf(path)
    assert (f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.add_space_prefix")) == \
        ("llama", None if style == "llama" else False)  # Llama's: absent (prefix); Gemma's: false
    ours = HFTokenizer.from_file(str(gguf_model_dir(path) / "tokenizer.json"))
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(source))
    assert ours.encode("🐍").tokens[-4:] == ["<0xF0>", "<0x9F>", "<0x90>", "<0x8D>"]  # byte fallback


def test_without_the_prefix_space_it_encodes_as_gemmas_tokenizer(converted) -> None:
    """GemmaTokenizer builds the same vocabulary otherwise (spaces replaced by a normalizer)."""
    from transformers import GemmaTokenizer

    source, path = converted("gemma")
    gemma = GemmaTokenizer.from_pretrained(source, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                           unk_token="<unk>", mask_token="<pad>")
    assert_same_tokenizer(HFTokenizer.from_file(str(gguf_model_dir(path) / "tokenizer.json")), gemma)


def test_greedy_tokens_equal_transformers_on_the_source_checkpoint(converted) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, path = converted("llama")
    # Prompts whose random-weight continuations stream: tokenizers' DecodeStream raises where a
    # byte token that decoded alone (<0x43>, "C") is followed by one that makes the run invalid
    # UTF-8 (<0xBF>: the prompt "<sep>" continues so), with transformers' own tokenizer.json too
    texts = [test_gguf_models.MULTILINGUAL, "Hello, world", "Return the value of the key.", " leading space",
             "a<sep>b x</s>y"]
    prompts = [AutoTokenizer.from_pretrained(source).encode(t) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    want = hf_greedy(model, prompts, 12)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22)
    outs = llm.generate(texts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == want


def spm_vocab(tmp_path) -> dict:
    """A vocabulary as the converter writes one from a SentencePiece model (its user-defined piece
    named by tokenizer_config.json)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(train_sentencepiece(tmp_path / "tokenizer.model", VOCAB)))
    ids = range(sp.get_piece_size())
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if sp.id_to_piece(i) == "<sep>" else 1 for i in ids]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in ids],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in ids], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


def write_vocab(path: Path, fields: dict) -> Path:
    """A GGUF file of these tokenizer.ggml.* fields alone (the tokenizer needs no tensor)."""
    w = GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_written_vocabulary_builds_a_tokenizer(tmp_path) -> None:
    """The fields the bad files below spoil make a tokenizer as they are: the eos token added
    where the file asks for it."""
    fields = {**spm_vocab(tmp_path), "tokenizer.ggml.add_eos_token": True}
    tok = HFTokenizer.from_str(json.dumps(tokenizer_json(read_gguf(write_vocab(tmp_path / "ok.gguf", fields)), VOCAB)))
    ids = tok.encode("the text").ids
    assert (ids[0], ids[-1], tok.decode(ids)) == (1, 2, "the text")


def spoiled(vocab: dict, change: str) -> dict:
    tokens, scores, types = (vocab[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    return {
        "scores short": {"tokenizer.ggml.scores": scores[:-1]},
        "scores words": {"tokenizer.ggml.scores": [str(s) for s in scores]},
        "score nan": {"tokenizer.ggml.scores": scores[:-1] + [float("nan")]},
        "no scores": {"tokenizer.ggml.scores": None},
        "byte token": {"tokenizer.ggml.tokens": [t.replace("<0x41>", "<0x4I>") for t in tokens]},
        "lower-case byte": {"tokenizer.ggml.tokens": [t.replace("<0x4A>", "<0x4a>") for t in tokens]},
        "duplicate": {"tokenizer.ggml.tokens": tokens[:-1] + [tokens[-2]]},
        "token type": {"tokenizer.ggml.token_type": types[:-1] + [9]},
        "types short": {"tokenizer.ggml.token_type": types[:-1]},
        "prefix flag": {"tokenizer.ggml.add_space_prefix": "yes"},
        "bos flag": {"tokenizer.ggml.add_bos_token": 1},
        "more tokens": {"tokenizer.ggml.tokens": tokens + ["extra"], "tokenizer.ggml.scores": scores + [-1e4],
                        "tokenizer.ggml.token_type": types + [1]},
        "model": {"tokenizer.ggml.model": "bert"},
    }[change]


@pytest.mark.parametrize("change, message", [
    ("scores short", "tokenizer.ggml.scores does not match tokenizer.ggml.tokens"),
    ("scores words", "tokenizer.ggml.scores holds a value that is not a finite number"),
    ("score nan", "tokenizer.ggml.scores holds a value that is not a finite number"),
    ("no scores", "lacks the metadata key 'tokenizer.ggml.scores'"),
    ("byte token", "token 70 '<0x4I>' is a byte token (tokenizer.ggml.token_type 6) but not spelled <0xNN>"),
    ("lower-case byte", "'<0x4a>' is a byte token"),
    ("duplicate", "tokenizer.ggml.tokens lists a token twice"),
    ("token type", "tokenizer.ggml.token_type holds a value that is not a token type"),
    ("types short", "tokenizer.ggml.token_type does not match tokenizer.ggml.tokens"),
    ("prefix flag", "tokenizer.ggml.add_space_prefix is 'yes', not true or false"),
    ("bos flag", "tokenizer.ggml.add_bos_token is 1, not true or false"),
    ("more tokens", f"the tokenizer has {VOCAB + 1} tokens, more than the model's vocabulary ({VOCAB})"),
    ("model", "tokenizer.ggml.model 'bert' is not read from GGUF yet"),
])
def test_a_vocabulary_that_does_not_fit_is_a_value_error_naming_the_file(tmp_path, change, message) -> None:
    vocab = spm_vocab(tmp_path)
    fields = {k: v for k, v in {**vocab, **spoiled(vocab, change)}.items() if v is not None}
    path = write_vocab(tmp_path / "bad.gguf", fields)
    with pytest.raises(ValueError, match="bad.gguf: ") as e:
        tokenizer_json(read_gguf(path), VOCAB)
    assert message in str(e.value)
