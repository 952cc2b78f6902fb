"""8-bit KV cache: round-trip error bounds, attention over quantized blocks equal to the reference
on the restored values, more blocks for the same memory, and the engine's regimes on top."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.attention.kv_quant import KVQuant, kv_bytes_per_token, make_kv_quant
from dabba.attention.torch_ref import TorchRefBackend
from dabba.config import DEMO_MODEL
from dabba.evaluation import perplexity
from tests.attention.test_backends import make_step
from tests.conftest import run_checked, token_prompts


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_round_trip_within_bounds(kind) -> None:
    torch.manual_seed(0)
    x = torch.randn(300, 4, 64) * torch.exp(torch.randn(300, 4, 1) * 2)  # vectors of very different ranges
    x[7, 2] = 0  # an all-zero vector must survive
    quant = KVQuant(kind, torch.float32)
    codes, scale = quant.quantize(x)
    assert codes.dtype == quant.storage_dtype and scale.shape == (300, 4) and scale.dtype == torch.float32
    err = (quant.dequantize(codes, scale) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        assert torch.equal(scale, (amax[..., 0] / 127).clamp(min=1e-12))
        assert (err <= amax / 254 * (1 + 1e-5)).all()  # half a step
        assert codes.abs().max() == 127
    else:  # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; below 2^-6 * scale, subnormal steps of 2^-9
        assert (err <= torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 1e-5)).all()
    assert torch.equal(quant.dequantize(codes[7, 2], scale[7, 2]), torch.zeros(64))


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_kv_quant("int4", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(DEMO_MODEL, kv_cache_dtype="fp16")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 1, 40, 8)])
def test_attention_over_quantized_blocks_equals_reference_on_restored_values(kind, num_heads, num_kv_heads,
                                                                             head_dim, block_size) -> None:
    torch.manual_seed(0)
    num_blocks = 64
    query_lens, context_lens = [1, 1, 37, 1, 5, 1], [70, 3, 0, 130, 40, 0]  # decodes, fresh and continued chunks
    common = make_step(query_lens, context_lens, block_size, num_blocks)
    T = sum(query_lens)
    q = torch.randn(T, num_heads, head_dim)
    k, v = torch.randn(T, num_kv_heads, head_dim), torch.randn(T, num_kv_heads, head_dim)
    ctx_k = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    ctx_v = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    quant = KVQuant(kind, torch.float32)
    restore = lambda x: quant.dequantize(*quant.quantize(x))  # noqa: E731

    quantized = TorchRefBackend(quant)
    shape = quantized.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    cache = (torch.zeros(shape, dtype=quant.storage_dtype), torch.zeros(shape[:-1]))
    reference = TorchRefBackend()
    ref_cache = torch.zeros(shape)
    outs = []
    for backend, kv_cache, (ck, cv, kk, vv) in ((quantized, cache, (ctx_k, ctx_v, k, v)),
                                                (reference, ref_cache, tuple(map(restore, (ctx_k, ctx_v, k, v))))):
        md = backend.build_metadata(common)
        key_cache, value_cache = backend.split_cache(kv_cache)
        backend.write_kv(key_cache, value_cache, ck, cv,
                         type(md)(torch.arange(num_blocks * block_size), None, None, None, None, []))
        outs.append(backend.forward(q, kk, vv, kv_cache, md, head_dim ** -0.5))
        outs.append(backend.gather_context(key_cache, value_cache, torch.arange(num_blocks)))
    got, (got_k, got_v), ref, (ref_k, ref_v) = outs
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    assert torch.equal(got, ref)
    assert cache[0].element_size() == 1 and (cache[0] != 0).any()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_more_blocks_fit_in_the_same_memory(kind) -> None:
    budget = 32 * 2**20
    auto = LLM(DEMO_MODEL, kv_cache_memory=budget).llm_engine
    quant = LLM(DEMO_MODEL, kv_cache_memory=budget, kv_cache_dtype=kind).llm_engine
    arch = auto.arch  # bf16 demo model: 2 bytes per element against 1 + 4/head_dim
    assert quant.cache_layout.bytes_per_block == 16 * 2 * arch.num_hidden_layers * arch.num_key_value_heads * (
        arch.head_dim + 4)
    assert quant.cache_layout.num_blocks == budget // quant.cache_layout.bytes_per_block
    assert quant.cache_layout.num_blocks / auto.cache_layout.num_blocks == pytest.approx(2 * 64 / 68, rel=1e-3)
    codes, scales = quant.model_runner.kv_caches[0]
    allocated = sum(c.nbytes + s.nbytes for c, s in quant.model_runner.kv_caches)
    assert allocated == quant.cache_layout.num_blocks * quant.cache_layout.bytes_per_block
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8) and scales.dtype == torch.float32


def test_bytes_per_token_formula() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert kv_bytes_per_token(30, 3, 64, "auto", torch.bfloat16) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(30, 3, 64, "int8", torch.bfloat16) == 2 * 30 * 3 * (64 + 4) == 12240
    assert kv_bytes_per_token(30, 3, 64, "fp8", torch.float32) == 12240


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_prefix_caching_chunking_and_preemption_keep_working(checkpoints, kind) -> None:
    """An 8-bit cache gives the same greedy tokens whether a context came in one piece, in chunks,
    from the prefix cache or again after preemption: every path attends the stored values."""
    ckpt = checkpoints["llama"]
    prompts = token_prompts(ckpt.prompts)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(ckpt.path), dtype="float32", kv_cache_dtype=kind, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in run_checked(plain, prompts, params)]
    # 24 blocks of 16 tokens (2 layers, 2 KV heads, head_dim 24): the longest request alone needs 22
    stressed = LLM(str(ckpt.path), dtype="float32", kv_cache_dtype=kind, max_num_batched_tokens=64,
                   kv_cache_memory=24 * 16 * 2 * 2 * 2 * (24 + 4))
    assert stressed.llm_engine.kv_cache_manager.num_blocks == 24
    outputs = run_checked(stressed, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    engine = stressed.llm_engine
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.prefix_stats.num_hit_tokens > 0


def test_int8_kv_perplexity_within_half_a_percent() -> None:
    text = Path(DEMO_MODEL, "heldout.txt").read_text()[:60_000]
    base = perplexity(LLM(DEMO_MODEL, attention_backend="torch_ref"), text).perplexity
    int8 = perplexity(LLM(DEMO_MODEL, kv_cache_dtype="int8"), text).perplexity
    assert abs(int8 / base - 1) < 0.005, (base, int8)
