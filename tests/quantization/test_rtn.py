"""Round-to-nearest INT8/INT4: the formulas, the kernels against dequantize-then-matmul, and
quantized models through the whole engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dabba import LLM, SamplingParams
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main
from dabba.layers.linear import Linear
from dabba.models.sizes import weights_bytes
from dabba.quantization.config import QuantConfig
from dabba.quantization.rtn import quantize, quantize_rows
from dabba.tools.evaluation import perplexity


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_asymmetric_int4_follows_the_formula(group_size) -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 256) * 0.05 + 0.01
    qw = quantize(w, 4, group_size, symmetric=False)
    g = w.view(16, -1, group_size)
    r_min, r_max = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    assert torch.allclose(qw.scale, (r_max - r_min) / 15)
    assert torch.equal(qw.zero, torch.round(-r_min / qw.scale).to(torch.int32))
    assert qw.q.min() >= 0 and qw.q.max() <= 15
    err = (qw.dequantize() - w).abs().view(16, -1, group_size)
    assert (err <= qw.scale[..., None] / 2 + 1e-7).all()


def test_symmetric_int8_per_channel_follows_the_formula() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    qw = quantize(w, 8, 64, symmetric=True)
    r_max = w.abs().amax(1, keepdim=True)
    assert torch.allclose(qw.scale, 2 * r_max / 255)
    assert (qw.zero == 0).all() and qw.q.min() >= -128 and qw.q.max() <= 127
    assert ((qw.dequantize() - w).abs() <= qw.scale / 2 + 1e-7).all()


@pytest.mark.parametrize("method, group_size", [("int8", 128), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])  # INT8 on CPU: dabba's GEMV, _weight_int8pack_mm, oneDNN
def test_kernels_equal_dequantize_then_matmul(method, group_size, dtype, rows) -> None:
    torch.manual_seed(0)
    layer = Linear(256, [96, 64], bias=True, shard_ids=("a", "b"), quant_config=QuantConfig(method, group_size))
    w = torch.randn(160, 256) * 0.05
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(160))
    layer.to(dtype)
    reference_weight = quantize(layer.weight.data, 8 if method == "int8" else 4,
                                256 if method == "int8" else group_size, symmetric=method == "int8").dequantize()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight is None  # only the packed form stays
    x = torch.randn(rows, 256, dtype=dtype)
    expected = F.linear(x.float(), reference_weight, layer.bias.float())
    got = layer(x).float()
    tol = 2e-4 if dtype == torch.float32 else 3e-2 * expected.abs().max().item()
    assert (got - expected).abs().max().item() < tol


def test_quantized_models_generate_through_the_engine(checkpoints) -> None:
    ckpt = checkpoints["llama"]  # int8 on a tiny checkpoint (its widths, 96 and 160, are not groups of 128)
    outs = LLM(str(ckpt.path), dtype="float32", quantization="int8").generate(
        [{"prompt_token_ids": p} for p in ckpt.prompts[:6]],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    sizes = {}
    for method in (None, "int8", "int4"):  # the demo model: every projection quantizes, int4 in groups of 128
        llm = LLM(DEMO_MODEL, quantization=method)
        sizes[method] = llm.llm_engine.engine_core.model_runner.weight_bytes
        out = llm.generate("The json module", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 12
    # the tied vocabulary is one INT8 table (a bf16 scale per row) that the embedding and the LM head
    # share, in place of the bf16 one; projections shrink 2x (int8), ~3.5x (int4)
    embedding, lm_head = 4096 * 384 * 2, 4096 * 384 + 4096 * 2
    assert (sizes["int8"] - lm_head) / (sizes[None] - embedding) == pytest.approx(0.5, abs=0.02)
    assert (sizes["int4"] - lm_head) / (sizes[None] - embedding) == pytest.approx(0.28, abs=0.03)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_a_tied_embedding_reads_its_rows_from_the_quantized_head(method) -> None:
    """No bf16 vocabulary table beside the INT8 head: the embedding looks rows up in the head's
    codes (W8A8's: in its packed layout), dequantized as the head dequantizes them, and the
    planner counts the one table."""
    llm = LLM(DEMO_MODEL, quantization=method)
    model = llm.llm_engine.engine_core.model_runner.model
    embedding, head = model.model.embed_tokens, model.lm_head
    assert embedding.weight is None and head.shares_packed_rows
    ids = torch.tensor([0, 5, 4095, 5])
    if method == "w8a8":  # the checkpoint's table rounded per row, read back out of the packed layout
        table = load_file(str(Path(DEMO_MODEL) / "model.safetensors"))["model.embed_tokens.weight"]
        q = quantize_rows(table, 8, table.shape[1], symmetric=True, codes_dtype=torch.int8)
        expected = (q.q[ids].float() * q.scale[ids, 0].float()[:, None]).to(torch.bfloat16)
        assert torch.equal(head.w8a8_scales, q.scale[:, 0].float())
    else:
        expected = head.qweight[ids].to(torch.bfloat16) * head.scales[ids, None]
    assert torch.equal(embedding(ids), expected)
    assert torch.equal(embedding(ids.view(2, 2)), expected.view(2, 2, -1))
    planned = weights_bytes(llm.llm_engine.resolved.arch, torch.bfloat16, QuantConfig(method), "cpu")
    assert planned == llm.llm_engine.engine_core.model_runner.weight_bytes


def test_demo_model_perplexity_int8_within_one_percent(tmp_path, capsys) -> None:
    text = (open(f"{DEMO_MODEL}/heldout.txt").read())[:20_000]
    base = perplexity(LLM(DEMO_MODEL), text, 128, 64)
    int8 = perplexity(LLM(DEMO_MODEL, quantization="int8"), text, 128, 64)
    int4 = perplexity(LLM(DEMO_MODEL, quantization="int4"), text, 128, 64)
    assert base.num_tokens == int8.num_tokens == int4.num_tokens > 4000
    assert 5 < base.perplexity < 200 and 0.5 < base.bits_per_byte < 4
    assert abs(int8.perplexity / base.perplexity - 1) < 0.01
    assert int4.perplexity > int8.perplexity * 0.99  # 4 bits lose at least as much as 8
    data = tmp_path / "text.txt"
    data.write_text(text[:4000])
    assert main(["eval", "perplexity", "--data", str(data), "--max-length", "64", "--stride", "32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_tokens"] > 500 and result["perplexity"] > 1 and result["bits_per_byte"] > 0
