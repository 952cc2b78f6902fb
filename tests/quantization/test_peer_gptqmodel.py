"""dabba's GPTQ and AWQ checkpoints interoperate with an independent implementation, GPTQModel:
what GPTQModel writes, dabba loads, and what dabba writes, GPTQModel loads, and both compute the
same float32 log-probabilities.

GPTQModel runs in its own venv, .venv-gptqmodel/ (scripts/peer-gptqmodel.sh, which CI runs), through
tests/quantization/peer_gptqmodel.py in a subprocess; it is never a dependency of dabba. Without
that venv these tests skip, except under CI (env CI set), where they fail.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.config import DEMO_MODEL
from tests.conftest import token_prompts

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-gptqmodel" / "bin" / "python"
PEER_SCRIPT = Path(__file__).with_name("peer_gptqmodel.py")
TOLERANCE = 1e-3  # float32 log-probs; measured differences are ~1e-5
TOP_K = 5  # besides each prompt token's own log-prob, the top 5 at every position are compared
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "calibration.txt")
DEMO_VOCAB = json.loads((Path(DEMO_MODEL) / "config.json").read_text())["vocab_size"]  # the models take its tokenizer


@pytest.fixture(scope="module")
def peer_python() -> Path:
    if not PEER_PYTHON.is_file():
        message = f"{PEER_PYTHON} is missing: run scripts/peer-gptqmodel.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run it before the tests)")
        pytest.skip(message)
    return PEER_PYTHON


def run_peer(python: Path, *args: str, cwd: Path) -> None:
    """``cwd``: a scratch folder, where GPTQModel leaves its logs/."""
    env = dict(os.environ)
    env.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default, (cores+1)//2, fails to quantize on 2 cores
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([str(python), str(PEER_SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode == 0, f"peer {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def save_random_bf16(config, path: Path) -> Path:
    """transformers' random init of config at seed 0, saved in bfloat16 with the demo tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(DEMO_MODEL) / name, path / name)
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A random tiny Llama in bfloat16 with the demo model's tokenizer: every linear has 128 | in_features."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("peer") / "source"
    config = LlamaConfig(vocab_size=DEMO_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=4, pad_token_id=0, tie_word_embeddings=True,
                         initializer_range=0.1)  # a wide init: log-probs far from uniform
    config.architectures = ["LlamaForCausalLM"]
    return save_random_bf16(config, path)


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> Path:
    """A random tiny Qwen3-MoE in bfloat16 (8 experts of 128, 2 per token), the demo tokenizer."""
    from transformers import Qwen3MoeConfig

    path = tmp_path_factory.mktemp("peer") / "moe-source"
    config = Qwen3MoeConfig(vocab_size=DEMO_VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=4, pad_token_id=0, tie_word_embeddings=True,
                            initializer_range=0.1)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return save_random_bf16(config, path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(DEMO_MODEL) / "tokenizer.json"))
    text = (Path(DEMO_MODEL) / "heldout.txt").read_text()
    ids = tok.encode(text[:20_000], add_special_tokens=False).ids
    g = torch.Generator().manual_seed(0)
    return [ids[:48], ids[1000:1100], [0] + ids[3000:3030], torch.randint(5, DEMO_VOCAB, (40,), generator=g).tolist()]


def dabba_logprobs(ckpt: Path, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
    """Per prompt, per position i >= 1: token id -> log-prob (the prompt token's and the top K)."""
    llm = LLM(str(ckpt), dtype="float32")
    outs = llm.generate(token_prompts(prompts), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP_K),
                        use_tqdm=False)
    result = []
    for out, p in zip(outs, prompts):
        positions = [{t: lp.logprob for t, lp in out.prompt_logprobs[i].items()} for i in range(1, len(p))]
        assert all(p[i] in positions[i - 1] and len(positions[i - 1]) >= TOP_K for i in range(1, len(p)))
        result.append(positions)
    return result


def peer_logprobs(python: Path, ckpt: Path, prompts: list[list[int]], tmp: Path) -> list[torch.Tensor]:
    """GPTQModel's float32 log-softmax, [len, vocab] per prompt."""
    (tmp / "tokens.json").write_text(json.dumps(prompts))
    run_peer(python, "logprobs", str(ckpt), str(tmp / "tokens.json"), str(tmp / "peer.pt"), cwd=tmp)
    return torch.load(tmp / "peer.pt")


def max_diff(ours: list[list[dict[int, float]]], theirs: list[torch.Tensor]) -> float:
    worst = 0.0
    for positions, lp in zip(ours, theirs):
        assert lp.dtype == torch.float32 and lp.shape[0] == len(positions) + 1
        for i, entries in enumerate(positions):  # position i + 1 is predicted from logits at i
            for token, value in entries.items():
                worst = max(worst, abs(value - lp[i, token].item()))
    return worst


@pytest.fixture(scope="module")
def source_logprobs(source, prompts) -> list[list[dict[int, float]]]:
    return dabba_logprobs(source, prompts)


def assert_agree(ckpt: Path, ours, theirs, source_logprobs, record_property) -> None:
    diff = max_diff(ours, theirs)
    # the tolerance means something: quantizing moved the log-probs far more than it
    quant_error = max(abs(v - s[t]) for a, b in zip(ours, source_logprobs) for x, s in zip(a, b)
                      for t, v in x.items() if t in s)
    record_property("max_abs_diff", diff)
    record_property("quantization_error", quant_error)
    print(f"{ckpt.name}: max |dabba - gptqmodel| = {diff:.3g}, max |quantized - source| = {quant_error:.3g}")
    assert quant_error > 20 * TOLERANCE, quant_error
    assert diff < TOLERANCE, diff


def quantization_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]


# --- GPTQModel writes, dabba reads --------------------------------------------------------------


@pytest.fixture(scope="module")
def peer_written(peer_python, source, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(method: str) -> Path:
        if method not in cache:
            out = tmp_path_factory.mktemp("peer") / f"gptqmodel-{method}"
            run_peer(peer_python, "write", str(source), str(out), method, cwd=out.parent)
            cache[method] = out
        return cache[method]

    return get


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dabba_reads_what_gptqmodel_writes(method, peer_python, peer_written, prompts, source_logprobs, tmp_path,
                                           record_property) -> None:
    ckpt = peer_written(method)
    config = quantization_config(ckpt)
    assert config["quant_method"] == method and config["bits"] == 4 and config["group_size"] == 128
    if method == "awq":
        assert config["zero_point"] is True and config.get("version", config.get("format")) == "gemm"
    else:
        assert config["sym"] is True and config["desc_act"] is False
    ours = dabba_logprobs(ckpt, prompts)
    theirs = peer_logprobs(peer_python, ckpt, prompts, tmp_path)
    assert_agree(ckpt, ours, theirs, source_logprobs, record_property)


def test_dabba_reads_a_mixture_of_experts_gptqmodel_quantized(peer_python, moe_source, prompts, tmp_path,
                                                              record_property) -> None:
    """GPTQModel quantizes each expert on the tokens routed to it (round-to-nearest where too few
    reach one, its default fallback); dabba loads the per-expert GPTQ tensors into its experts."""
    ckpt = tmp_path / "gptqmodel-moe-gptq"
    run_peer(peer_python, "write", str(moe_source), str(ckpt), "gptq", cwd=tmp_path)
    assert quantization_config(ckpt)["quant_method"] == "gptq"
    from safetensors import safe_open

    names = {n for f in ckpt.glob("*.safetensors") for n in safe_open(str(f), "pt").keys()}
    assert all(f"model.layers.{i}.mlp.experts.{e}.{p}.qweight" in names
               for i in range(2) for e in range(8) for p in ("gate_proj", "up_proj", "down_proj"))
    ours = dabba_logprobs(ckpt, prompts)
    theirs = peer_logprobs(peer_python, ckpt, prompts, tmp_path)
    assert_agree(ckpt, ours, theirs, dabba_logprobs(moe_source, prompts), record_property)


# --- dabba writes, GPTQModel reads --------------------------------------------------------------


@pytest.mark.parametrize("method,flags", [("gptq", []), ("gptq", ["--act-order"]), ("awq", [])],
                         ids=["gptq", "gptq-act-order", "awq"])
def test_gptqmodel_reads_what_dabba_writes(method, flags, peer_python, source, prompts, source_logprobs, tmp_path,
                                           record_property) -> None:
    from dabba.entrypoints.cli import main

    ckpt = tmp_path / f"dabba-{method}{'-act-order' if flags else ''}"
    assert main(["quantize", str(source), str(ckpt), "--method", method, "--bits", "4", "--group-size", "128",
                 "--num-samples", "16", "--seq-len", "128", *flags]) == 0
    config = quantization_config(ckpt)
    assert config["quant_method"] == method
    if flags:
        assert config["desc_act"] is True
    ours = dabba_logprobs(ckpt, prompts)
    theirs = peer_logprobs(peer_python, ckpt, prompts, tmp_path)
    assert_agree(ckpt, ours, theirs, source_logprobs, record_property)
