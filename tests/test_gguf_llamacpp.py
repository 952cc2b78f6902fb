"""Quantized GGUF files against llama.cpp itself (issue 41's bar): tiny random checkpoints converted
by llama.cpp's convert_hf_to_gguf.py and quantized by its llama_model_quantize (the presets Q8_0,
Q4_0, Q4_K_M, Q5_K_M, Q6_K), then generated greedily by dabba (the decode GEMV, float32) and by
llama.cpp (tests/peer_llamacpp.py, in .venv-llamacpp/): over the first 32 generated positions of
each prompt, dabba's token is llama.cpp's wherever llama.cpp's top two lie more than 0.1 nats
apart (a nearer pair may go either way, and the contexts part there), and the chosen tokens'
log-probabilities differ by at most 0.02 nats on average.

Two shapes: the suite's llama checkpoint (hidden 96: llama-quantize keeps the K presets to types
whose blocks fit, Q5_0, Q5_1, Q8_0, so the legacy kernels), and a 256-wide one made here (the K
types themselves), its norms perturbed: with norms of ones, a quantized embedding's values sit on
a grid and many an activation at a half of its 8-bit step, where a difference of one ulp upstream
(the two engines' RMSNorm) moves its code. dabba rounds activations code for code as llama.cpp's
x86 kernels do, so on the 256-wide files the chosen tokens' logprobs differ by 0.0001-0.003 nats
on average; the hidden-96 checkpoint, norms of ones, by up to 0.016. The peer venv comes from scripts/peer-llamacpp.sh, which CI runs; without it
these tests skip, except under CI, where they fail.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dabba import LLM, SamplingParams
from tests.gguf_families import LLAMA_CPP, REPO, converter_view, make_gguf
from tools.tiny_checkpoint import make_checkpoint

PEER_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
TYPES = ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]
NEW = 32
MARGIN = 0.1  # nats: where llama.cpp's top two lie closer, either token is the model's
MEAN_LOGPROB_DIFFERENCE = 0.02  # nats
# every family but llama (the shapes below) on a file of the default preset, Q4_K_M, but the
# mixtures of experts: a token's experts are a discrete choice, and where two experts' router
# logits nearly tie, the quantization's noise upstream flips it and moves the next token by more
# than MARGIN without any near tie among the tokens (seen on these random checkpoints, twice in six
# prompts at Q4_K_M). At Q8_0, with one such prompt allowed (ROUTING_FLIPS), they hold the bar.
FAMILY_TYPES = {"qwen2": "q4_k_m", "qwen3": "q4_k_m", "phi3": "q4_k_m", "gemma3": "q4_k_m", "gemma2": "q4_k_m",
                "mixtral": "q8_0",
                "qwen3moe": "q8_0", "olmoe": "q8_0"}
MOE_FAMILIES, ROUTING_FLIPS = ("mixtral", "qwen3moe", "olmoe"), 1


@pytest.fixture(scope="module")
def peer_python() -> Path:
    if not PEER_PYTHON.is_file() or not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        message = f"{PEER_PYTHON} or {LLAMA_CPP} is missing: run scripts/peer-llamacpp.sh"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run it before the tests)")
        pytest.skip(message)
    return PEER_PYTHON


@pytest.fixture(scope="module")
def sources(checkpoints, tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """shape -> (checkpoint, prompts)."""
    wide = make_checkpoint(tmp_path_factory.mktemp("wide"), "LlamaForCausalLM", initializer_range=0.05,
                           hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, tokenizer_vocab_size=512, norm_std=0.1)
    llama = checkpoints["llama"]
    prompts = [p[:40] for p in llama.prompts[:8]]
    return {"hidden 96": (llama.path, prompts), "hidden 256": (wide, [[t % 500 + 3 for t in p] for p in prompts])}


@pytest.fixture(scope="module")
def quantized(peer_python, sources, tmp_path_factory):
    """(shape, type) -> the file llama.cpp's tools made, once per module."""
    made: dict[tuple[str, str], Path] = {}

    def get(shape: str, gguf_type: str) -> Path:
        if shape not in {s for s, _ in made}:
            files = make_gguf(sources[shape][0], tmp_path_factory.mktemp("gguf"), TYPES, str(peer_python))
            made.update({(shape, t): path for t, path in files.items()})
        return made[shape, gguf_type]

    return get


def llamacpp_greedy(python: Path, path: Path, prompts: list[list[int]], tmp_path: Path) -> list[list[dict]]:
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    result = subprocess.run([str(python), str(REPO / "tests" / "peer_llamacpp.py"), "--gguf", str(path), "--prompts",
                             str(tmp_path / "prompts.json"), "--new", str(NEW), "--out", str(tmp_path / "out.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def compare(ours, theirs: list[list[dict]], routing_flips: int = 0) -> list[float]:
    """The log-probability differences at the positions whose contexts agree; dabba's token is
    llama.cpp's at each of them, and where it is not, llama.cpp's margin is within MARGIN (the
    contexts part there), but for up to ``routing_flips`` prompts (a mixture of experts' choice
    flipped by a near tie among its router's logits, which the tokens' margin does not show)."""
    differences = []
    for prompt, (mine, steps) in enumerate(zip(ours, theirs)):
        for i, step in enumerate(steps):
            token = mine.token_ids[i]
            if token != step["token"]:
                margin = step["logprob"] - step["runner_up"]
                if margin > MARGIN and routing_flips:
                    routing_flips -= 1
                    break
                assert margin <= MARGIN, (f"prompt {prompt}, position {i}: dabba {token}, llama.cpp {step['token']} "
                                          f"with a margin of {margin:.3f} nats")
                break
            differences.append(abs(mine.logprobs[i][token].logprob - step["logprob"]))
    assert len(differences) >= NEW  # at least a prompt's worth of positions compared
    return differences


@pytest.mark.parametrize("shape", ["hidden 96", "hidden 256"])
@pytest.mark.parametrize("gguf_type", TYPES)
def test_greedy_tokens_and_logprobs_follow_llamacpp(shape, gguf_type, peer_python, sources, quantized,
                                                    tmp_path) -> None:
    """Prompts prefilled 8 tokens a step go through the GEMV as decode does, prefilled whole through
    the GEMM on dequantized weights; both round the activations to 8 bits as llama.cpp rounds every
    batch's, and both hold the issue's 0.02 nats."""
    path = quantized(shape, gguf_type)
    prompts = sources[shape][1]
    theirs = llamacpp_greedy(peer_python, path, prompts, tmp_path)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    for chunk in (8, 4096):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=chunk)
        ours = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        differences = compare(ours, theirs)
        mean = sum(differences) / len(differences)
        assert mean <= MEAN_LOGPROB_DIFFERENCE, (chunk, mean)


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_each_family_follows_llamacpp(family, peer_python, gguf_sources, tmp_path) -> None:
    """Every family, decoded through the GEMV as the shapes above (Q4_K_M at these widths:
    llama-quantize's fallbacks Q5_0, Q5_1 and Q8_0, and Q6_K where a row holds 256 values)."""
    ckpt = gguf_sources[family]
    view = converter_view(family, ckpt.path, tmp_path / "source")
    gguf_type = FAMILY_TYPES[family]
    path = make_gguf(view, tmp_path / "gguf", [gguf_type], str(peer_python))[gguf_type]
    prompts = [p[:40] for p in ckpt.prompts[:6]]
    theirs = llamacpp_greedy(peer_python, path, prompts, tmp_path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=2**22, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    ours = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    differences = compare(ours, theirs, ROUTING_FLIPS if family in MOE_FAMILIES else 0)
    assert sum(differences) / len(differences) <= MEAN_LOGPROB_DIFFERENCE, sum(differences) / len(differences)
