"""8-bit KV cache: round-trip error bounds, attention over quantized blocks equal to the reference
on the restored values, the native CPU backend equal to the reference backend (codes and scales
bit for bit, attention within float tolerance), more blocks for the same memory, and the engine's
regimes on top."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.attention.cpu import CpuBackend
from dabba.attention.kv_quant import KVQuant, kv_bytes_per_token, make_kv_quant
from dabba.attention.selector import get_attention_backend
from dabba.attention.torch_ref import TorchRefBackend
from dabba.config import DEMO_MODEL
from dabba.ops.native import load_cpu_ops
from dabba.tools.evaluation import perplexity
from tests.attention.test_backends import make_step
from tests.conftest import run_checked, token_prompts

needs_kernels = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")


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


def empty_cache(backend, quant: KVQuant, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=quant.storage_dtype), torch.zeros(shape[:-1])


def reference_layout(codes: torch.Tensor) -> torch.Tensor:
    """The CPU backend's codes [2, kv_heads, blocks, block_size, d] (keys transposed per block) in
    the reference backend's layout."""
    _, kv_heads, blocks, block_size, d = codes.shape
    return torch.stack([codes[0].view(kv_heads, blocks, d, block_size).transpose(2, 3), codes[1]])


def run_native_and_reference(kind, dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens,
                             sliding_window=None, softcap=None, scale=None, num_blocks=80):
    """One step on the reference and the CPU backend, both with the same 8-bit cache dtype, each
    cache first filled with the same earlier tokens through its backend's write_kv. The reference
    runs on the same inputs in float32 (the same codes: KVQuant quantizes x.float()): in bf16 it
    rounds the restored keys and values, and the probabilities, to bf16, where the kernels keep
    float32. Per backend: the output (float32) and the cache (codes in the reference layout, scales)."""
    torch.manual_seed(0)
    common = make_step(query_lens, context_lens, block_size, num_blocks)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, head_dim, dtype=dtype) for h in (num_heads, num_kv_heads, num_kv_heads))
    context = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype)
    results = []
    for backend, x_dtype in ((TorchRefBackend(KVQuant(kind, torch.float32)), torch.float32),
                             (CpuBackend(KVQuant(kind, dtype)), dtype)):
        cache = empty_cache(backend, backend.kv_quant, num_blocks, block_size, num_kv_heads, head_dim)
        backend.write_kv(*backend.split_cache(cache), context[0].to(x_dtype), context[1].to(x_dtype),
                         SimpleNamespace(slot_mapping=torch.arange(num_blocks * block_size)))
        out = backend.forward(q.to(x_dtype), k.to(x_dtype), v.to(x_dtype), cache, backend.build_metadata(common),
                              scale or head_dim ** -0.5, sliding_window, softcap)
        codes = cache[0] if isinstance(backend, TorchRefBackend) else reference_layout(cache[0])
        results.append((out.float(), codes, cache[1]))
    return results


# float32: the kernels' sums in another order; bf16: the output's rounding (half an ulp: 2^-9 relative)
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=0), torch.bfloat16: dict(atol=1e-3, rtol=2**-8)}
SHAPES = [(9, 3, 64, 16), (8, 1, 32, 16), (12, 2, 128, 16), (9, 9, 16, 16),  # query heads in groups of 3, 8, 6, 1
          (4, 2, 24, 16), (6, 6, 16, 8), (4, 1, 40, 32), (18, 2, 16, 16)]  # per-head loops: other shapes, groups of 9
STEPS = {"mixed": ([1, 1, 37, 1, 5, 1], [70, 3, 0, 130, 40, 0]),  # decodes, fresh and continued chunks
         "decodes": ([1, 1, 1], [70, 0, 130]),
         "long": ([150, 1, 33], [0, 17, 260])}  # prompts of many tiles


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("step", sorted(STEPS))
def test_native_backend_matches_reference_with_an_8bit_cache(kind, dtype, num_heads, num_kv_heads, head_dim,
                                                             block_size, step) -> None:
    (ref, ref_codes, ref_scales), (got, got_codes, got_scales) = run_native_and_reference(
        kind, dtype, num_heads, num_kv_heads, head_dim, block_size, *STEPS[step])
    assert torch.equal(got_codes, ref_codes) and torch.equal(got_scales, ref_scales), "the caches differ"
    assert (got_codes != 0).any()
    torch.testing.assert_close(got, ref, **TOLERANCE[dtype])


# Windows below, at and across block boundaries and the contexts' lengths (test_backends.py's);
# Gemma's shapes (head_dim 256, GQA 4:1 and 1:1) with a soft cap that bites; the per-head loops.
@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window, softcap", [(1, None), (16, None), (23, None), (71, None), (None, 5.0),
                                                     (40, 5.0), (23, 50.0)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 2, 256, 16), (4, 4, 256, 16), (4, 2, 24, 8)])
@pytest.mark.parametrize("step", ["mixed", "decodes"])
def test_native_backend_matches_reference_with_a_window_and_softcap(kind, dtype, sliding_window, softcap, num_heads,
                                                                    num_kv_heads, head_dim, block_size, step) -> None:
    scale = 0.5 if softcap == 5.0 else None  # raw scores of ~10 at head_dim 256: a cap of 5 saturates many
    (ref, _, _), (got, _, _) = run_native_and_reference(kind, dtype, num_heads, num_kv_heads, head_dim, block_size,
                                                        *STEPS[step], sliding_window, softcap, scale)
    torch.testing.assert_close(got, ref, **TOLERANCE[dtype])


def rows_covering_every_value(kind: str, dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Rows whose first element is q_max, so that scale = 1 and the codes are the other elements
    converted as they are: every value of ``dtype`` in [-q_max, q_max] (all of bfloat16's, subnormals
    included), every midpoint between neighbouring codes (the ties), and random float32 values."""
    q_max = KVQuant(kind, dtype).q_max
    if kind == "int8":
        codes = torch.arange(-127, 128, dtype=torch.float32)
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[codes.isfinite()].unique()
    values = [codes, (codes[1:] + codes[:-1]) / 2, torch.empty(4096).uniform_(-q_max, q_max)]
    if dtype == torch.bfloat16:
        every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        values.append(every[every.isfinite() & (every.abs() <= q_max)])
    x = torch.cat(values).to(dtype)
    x = torch.cat([x, x.new_zeros(-len(x) % (head_dim - 1))]).view(-1, head_dim - 1)
    return torch.cat([x.new_full((len(x), 1), q_max), x], dim=1)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [24, 128])
def test_write_kv_cache_quantizes_exactly_as_kvquant(kind, dtype, head_dim) -> None:
    """The C++ quantization (csrc/paged_attention_cpu.cpp, quantize_row) against KVQuant.quantize,
    bit for bit: every representable input near the codes, ties, vectors of wildly different ranges
    (subnormal codes, the 1e-12 floor), an all-zero one."""
    torch.manual_seed(1)
    quant = KVQuant(kind, dtype)
    covering = rows_covering_every_value(kind, dtype, head_dim)
    ranged = torch.randn(600, head_dim) * torch.exp(torch.randn(600, 1) * 6)
    ranged[7] = 0
    ranged[8] = 1e-20  # below the scale's floor
    rows = torch.cat([covering, ranged.to(dtype)])
    rows = rows[rows.isfinite().all(1)]
    num_kv_heads, block_size = 2, 16
    rows = rows[: len(rows) // num_kv_heads * num_kv_heads]
    k = rows.view(-1, num_kv_heads, head_dim)
    v = k.flip(0).contiguous()
    num_blocks = -(-len(k) // block_size) + 1
    backend = CpuBackend(quant)
    cache = empty_cache(backend, quant, num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[: len(k)]
    backend.write_kv(*backend.split_cache(cache), k, v, SimpleNamespace(slot_mapping=slots))
    codes, scales = reference_layout(cache[0]), cache[1]
    for i, x in enumerate((k, v)):
        expected_codes, expected_scales = quant.quantize(x)
        stored = codes[i].flatten(1, 2)[:, slots].transpose(0, 1)  # [tokens, kv_heads, d]
        assert torch.equal(stored, expected_codes)
        assert torch.equal(scales[i].flatten(1, 2)[:, slots].T, expected_scales)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_kernels_read_every_code(kind) -> None:
    """Caches whose codes run through every value (int8: -128 too, which KVQuant never writes;
    fp8: subnormals and both zeros, all but NaN) with random scales, written directly: the kernels'
    16-lane widening against the reference's dequantization, on a decode and a prompt chunk."""
    torch.manual_seed(2)
    quant = KVQuant(kind, torch.float32)
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 40, 16, 2, 64, 6
    every = torch.arange(256, dtype=torch.uint8)
    if kind == "fp8":
        every = every[(every & 0x7F) != 0x7F]
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    codes = every[torch.randint(len(every), shape)].view(quant.storage_dtype)
    scales = (torch.rand(shape[:-1]) + 0.5) / quant.q_max  # values of about unit size: well-conditioned scores
    common = make_step([1, 1, 20], [300, 77, 150], block_size, num_blocks)
    q, k, v = (torch.randn(22, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads))
    outs = []
    for backend in (TorchRefBackend(quant), CpuBackend(quant)):
        own_codes = codes.clone()
        if isinstance(backend, CpuBackend):  # the same logical keys, transposed per block
            own_codes[0] = codes[0].transpose(2, 3).reshape(codes[0].shape)
        outs.append(backend.forward(q, k, v, (own_codes, scales.clone()), backend.build_metadata(common), 0.2))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)


@needs_kernels
def test_the_native_backend_takes_8bit_caches() -> None:
    quant = make_kv_quant("int8", torch.bfloat16)
    for name in ("auto", "cpu"):
        backend = get_attention_backend(name, torch.device("cpu"), quant)
        assert isinstance(backend, CpuBackend) and backend.kv_quant is quant
    assert isinstance(get_attention_backend("torch_ref", torch.device("cpu"), quant), TorchRefBackend)
    llm = LLM(DEMO_MODEL, kv_cache_dtype="fp8", kv_cache_memory=2**22)
    runner = llm.llm_engine.engine_core.model_runner
    assert isinstance(runner.backend, CpuBackend) and runner.native_loop is not None


@needs_kernels
@pytest.mark.parametrize("family, kind", [("llama", "int8"), ("mistral", "fp8")])  # GQA 2:1; 4:1 in a 40-key window
def test_engine_native_and_reference_give_the_same_greedy_tokens(checkpoints, family, kind) -> None:
    """The whole engine in float32, an 8-bit cache on the native backend and layer loop against the
    reference backend and the Python layers: the same greedy tokens (bf16 rounds apart on near-ties,
    as bf16 caches do)."""
    ckpt = checkpoints[family]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = []
    for backend in ("auto", "torch_ref"):
        llm = LLM(str(ckpt.path), dtype="float32", kv_cache_dtype=kind, attention_backend=backend,
                  kv_cache_memory=2**22)
        assert (llm.llm_engine.engine_core.model_runner.native_loop is not None) == (backend == "auto")
        outputs.append([o.outputs[0].token_ids for o in llm.generate(token_prompts(ckpt.prompts), params,
                                                                     use_tqdm=False)])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_more_blocks_fit_in_the_same_memory(kind) -> None:
    budget = 32 * 2**20
    auto_engine = LLM(DEMO_MODEL, kv_cache_memory=budget).llm_engine
    auto = auto_engine.engine_core
    quant = LLM(DEMO_MODEL, kv_cache_memory=budget, kv_cache_dtype=kind).llm_engine.engine_core
    arch = auto_engine.resolved.arch  # bf16 demo model: 2 bytes per element against 1 + 4/head_dim
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
    assert stressed.llm_engine.engine_core.kv_cache_manager.num_blocks == 24
    outputs = run_checked(stressed, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    engine = stressed.llm_engine
    core = engine.engine_core
    assert core.scheduler.num_preemptions > 0 and core.kv_cache_manager.prefix_stats.num_hit_tokens > 0


def test_int8_kv_perplexity_within_half_a_percent() -> None:
    text = Path(DEMO_MODEL, "heldout.txt").read_text()[:60_000]
    base = perplexity(LLM(DEMO_MODEL, attention_backend="torch_ref"), text).perplexity
    int8 = perplexity(LLM(DEMO_MODEL, kv_cache_dtype="int8"), text).perplexity
    assert abs(int8 / base - 1) < 0.005, (base, int8)
