"""A GGUF file's quantized linears stay in their blocks (quantization/gguf.py): a small Llama of
random blocks in seven types (tests/gguf_writer.py), its token embedding and LM head float,
quantized, or tied and quantized, holds the file's bytes, not a float copy (Q4_0 in dabba's layout
of the same bytes, quantization/gguf_repack.py); the planner counts those bytes; and it generates
what the same weights written dequantized as F32 generate, within the 8-bit activations' rounding."""
from __future__ import annotations

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.arch.config import ArchConfig
from dabba.models.gguf_checkpoint import gguf_model_dir
from dabba.models.sizes import weights_bytes
from dabba.ops import native
from dabba.quantization.config import QuantConfig
from dabba.quantization.gguf import GGUFLinearMethod
from dabba.quantization.gguf_repack import layout_for
from tests.gguf_writer import LAYERS, LINEAR_TYPES, write_llama

PROMPT = {"prompt_token_ids": [0, 5, 9, 33, 100, 7, 8, 250, 17, 3]}


TABLES = {"float": {}, "tied Q6_K": {"embedding": "Q6_K", "head": None},
          "Q4_0 embedding, Q8_0 head": {"embedding": "Q4_0", "head": "Q8_0"},
          "Q4_K ffn_down": {"types": {**LINEAR_TYPES, "ffn_down": "Q4_K"}}}


@pytest.fixture(scope="module", params=list(TABLES))
def files(tmp_path_factory, request):
    """(the quantized file, the same weights as F32), with the token embedding and LM head as named."""
    d = tmp_path_factory.mktemp("gguf")
    tables = TABLES[request.param]
    return write_llama(d / "q.gguf", **tables), write_llama(d / "f.gguf", quantized=False, **tables)


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.model_runner.model


def test_the_model_holds_the_files_blocks_and_the_planner_counts_them(files) -> None:
    from gguf import GGUFReader

    quantized, _ = files
    tensors = {t.name: t for t in GGUFReader(quantized).tensors}
    blocks = {name: int(t.n_bytes) for name, t in tensors.items() if t.tensor_type.name not in ("F32",)}
    model = model_of(LLM(quantized, dtype="bfloat16", kv_cache_memory=2**22))
    held = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    assert len(held) == 4 * LAYERS + ("token_embd.weight" in blocks or "output.weight" in blocks)
    assert all(m.weight is None for m in held)
    if native.load_cpu_ops():  # Q4_0 and Q4_K rows of 512 values, Q6_K's of 256, in the GEMV's layouts
        for m in held:
            assert m.gguf_segment_types == [layout_for(t, m.in_features) or t for t in m.quant_method.shard_types]
        assert model.model.layers[0].mlp.down_proj.gguf_segment_types[0] in ("Q4_0x16", "Q4_Kx2")
    embedding = model.model.embed_tokens
    assert (embedding.gguf_rows is not None or embedding.packed_rows is not None) == ("token_embd.weight" in blocks)
    held_bytes = sum(m.gguf_blob.numel() for m in held)
    if "token_embd.weight" in blocks and "output.weight" in tensors:  # untied: the table's own blocks
        held_bytes += embedding.gguf_rows.data.numel()
    assert held_bytes == sum(blocks.values())
    directory = gguf_model_dir(quantized)
    arch = ArchConfig.from_hf(directory)
    planned = weights_bytes(arch, torch.bfloat16, QuantConfig.from_checkpoint(arch.quantization_config))
    others = sum(p.numel() * 2 for p in model.parameters() if p is not None)  # norms, float tables
    assert planned == held_bytes + others


def top_two(llm: LLM, prompt: list[int]) -> list[list[tuple[int, float]]]:
    """At each prompt position after the first, the model's two likeliest next tokens (teacher forced)."""
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    return [sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda x: -x[1])[:2] for d in out.prompt_logprobs[1:]]


# The top two's margin beyond which the quantized model must pick the reference's token. In float32,
# the bar the issue sets against llama.cpp; bfloat16 rounds every layer's output to 8 bits of mantissa,
# which alone moves the reference's own margin by up to about 0.05 nats between this build's kernel
# variants (avx512 against avx2: their sums run in other orders), and the quantized model's as much.
DECIDED_MARGIN = {"float32": 0.1, "bfloat16": 0.2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top_tokens_and_logprobs_follow_the_dequantized_weights(files, dtype) -> None:
    """Over 96 teacher-forced positions, the likeliest token is the reference's wherever the
    reference's top two lie more than DECIDED_MARGIN apart, and the top token's logprob differs
    little on average."""
    prompt = [(7 * i * i + 3 * i + 1) % 300 for i in range(97)]
    quantized, reference = (top_two(LLM(path, dtype=dtype, kv_cache_memory=2**22), prompt) for path in files)
    decided = [i for i, ref in enumerate(reference) if ref[0][1] - ref[1][1] > DECIDED_MARGIN[dtype]]
    assert len(decided) > 30
    assert all(quantized[i][0][0] == reference[i][0][0] for i in decided)
    differences = [abs(q[0][1] - r[0][1]) for q, r in zip(quantized, reference)]
    assert sum(differences) / len(differences) < 0.05


# The quantized model rounds every activation to 8-bit codes (the prompt's too, as llama.cpp does),
# the reference none: their logits part by up to about 0.06 nats at a position, so their top two's
# difference by up to twice that. A nearer pair may go either way.
GREEDY_MARGIN = 0.15


def test_greedy_decode_follows_the_dequantized_weights(files) -> None:
    """Decode (the native layer loop, the GEMV) picks the reference's tokens until a position
    where the reference's own top two lie within GREEDY_MARGIN, where either pick is the model's."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    quantized, reference = (LLM(path, dtype="float32", kv_cache_memory=2**22).generate(
        PROMPT, params, use_tqdm=False)[0].outputs[0] for path in files)
    for i, (ours, theirs) in enumerate(zip(quantized.token_ids, reference.token_ids)):
        if ours != theirs:
            top = sorted((lp.logprob for lp in reference.logprobs[i].values()), reverse=True)
            margin = top[0] - top[1]
            assert margin <= GREEDY_MARGIN, f"position {i}: {ours} against {theirs}, margin {margin:.3f}"
            break
