"""W8A8 (quantization="w8a8": INT8 weights times activations rounded to 8-bit codes per row at run
time, summed exactly in int32; quantization/w8a8.py, csrc/w8a8_cpu.cpp) with every other engine
feature, end to end against the same model with the feature off: continuous batching, chunked
prefill, prefix caching, speculative decoding (n-gram, the model itself, its first layer), the
8-bit KV caches, preemption, mixture-of-experts models, tensor and data parallelism. A small
random Llama (tests/conftest.py's "llama" shape), and conftest's three MoE shapes.

Greedy tokens are equal (``assert_same``): each row of activations is rounded with its own scale
and summed exactly in integers, so a W8A8 layer's row is the same bits whichever kernel its step
takes (AMX tiles from 16 rows where the CPU has them, VNNI or AVX2 below; the first test holds them
equal row by row) and whichever rows share the step; the LM head is W8A8 too
(QuantConfig.get_lm_head_method), so a request's logits are the same bits alone and in a batch.
Where the arithmetic itself changes (an 8-bit KV cache against a float one, tensor parallelism's
all-reduce) the tokens are held by ``assert_follows`` and a perplexity or logprob bar, as
tests/test_gguf_features.py holds its quantized GGUF models."""
from __future__ import annotations

import math

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.config import EngineConfig
from dabba.ops import native
from dabba.quantization import w8a8
from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.w8a8 import W8A8Method
from tests.conftest import CHECKPOINTS, INIT_STD, own_text_perplexities, quotation_prompts, run_checked, token_prompts
from tests.distributed import test_data_parallel, test_tensor_parallel
from tests.test_gguf_features import assert_follows, assert_same, token_ids
from tools.tiny_checkpoint import first_layers, make_checkpoint

threaded = test_tensor_parallel.threaded  # LLM(tensor_parallel_size=2) runs its ranks as threads here
needs_kernels = pytest.mark.skipif(not native.load_cpu_ops(), reason="native kernels unavailable")

VOCAB = 1024  # tools/tiny_checkpoint.py's tokenizer
# Prefills of 9 rows (below AMX's 16: VNNI) and of 25 or more (AMX where the CPU has it); chunks
# of 16 leave last chunks of 9 (VNNI), 16 + 9, ..., 6 x 16 + 14; decodes of 1-5 rows (VNNI).
PROMPT_LENS = (9, 25, 41, 64, 110)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


PROMPTS = quotation_prompts(PROMPT_LENS, VOCAB, lowest=3)  # n-gram lookups find spans of them


def checkpoint(tmp_path_factory, family: str) -> str:
    spec = dict(CHECKPOINTS[family])
    return str(make_checkpoint(tmp_path_factory.mktemp(family), spec.pop("arch"), initializer_range=INIT_STD, **spec))


def engine(path: str, dtype: str = "float32", kv_cache_memory: int = 2**22, **options) -> LLM:
    return LLM(path, dtype=dtype, quantization="w8a8", kv_cache_memory=kv_cache_memory, **options)


def one_by_one(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    return [llm.generate(p, params, use_tqdm=False)[0].outputs[0] for p in token_prompts(prompts)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def references(model):
    """Each prompt's greedy output run alone, without prefix caching, per dtype: the reference."""
    done = {}

    def alone(dtype: str = "float32") -> list:
        if dtype not in done:
            llm = engine(model, dtype, enable_prefix_caching=False)
            assert len(w8a8_layers(llm)) == 4 * 2 + 1  # qkv, o, gate_up, down of both layers; the head
            done[dtype] = one_by_one(llm, PROMPTS)
        return done[dtype]
    return alone


@pytest.fixture(scope="module")
def alone(references) -> list:
    return references("float32")


def w8a8_layers(llm: LLM) -> list:
    """The model's W8A8 layers, its LM head among them (QuantConfig.get_lm_head_method)."""
    model = llm.llm_engine.engine_core.model_runner.model
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), W8A8Method)]


# ---- the kernels: a row's output does not depend on the rows beside it ------------------------------------------

@needs_kernels
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_row_alone_equals_the_same_row_in_a_batch_of_40(dtype, asymmetric) -> None:
    """path="" chooses the kernel by the number of rows (csrc/w8a8_cpu.cpp: w8a8_path): AMX tiles
    from amx_w8a8_min_rows (12) where the CPU has them, VNNI/AVX2 below. Each row alone (decode's
    path), the leading 1 to 17 rows (both sides of the switch), and the 40 rows at once give the
    same bits, and the PyTorch reference's. Rows of scales 1e-3 to 30, one of zeros, one with an
    outlier; K over the kernels' K block (1024) and N over their channel block (256), neither whole."""
    amx_rows = native.kernel_constants().amx_w8a8_min_rows
    paths = {m: torch.ops.dabba_cpu.w8a8_path(m, 96) for m in (1, 8, amx_rows - 1, amx_rows, 40)}
    assert paths[1] == paths[8] == paths[amx_rows - 1] != "amx" and amx_rows <= 40
    assert paths[amx_rows] == paths[40] and (paths[40] == "amx") == (paths[40] != paths[1])  # AMX where the CPU has it
    g = torch.Generator().manual_seed(1)
    for k, n in ((96, 100), (2100, 300)):
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, generator=g) * 0.01 + 1e-4
        packed, wsum = w8a8.pack_weight(codes), codes.to(torch.int32).sum(dim=1, dtype=torch.int32)
        row_scales = torch.logspace(-3, math.log10(30), 40)[torch.randperm(40, generator=g)]
        x = torch.randn(40, k, generator=g) * row_scales[:, None]
        x[7] = 0
        x[20, 5] = 500.0
        x = x.to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        for b in (None, bias):
            whole = w8a8.w8a8_linear(x, packed, wsum, scales, b, asymmetric)
            assert torch.equal(whole, w8a8.w8a8_reference(x, codes, scales, b, asymmetric))
            for i in range(40):
                row = w8a8.w8a8_linear(x[i:i + 1].contiguous(), packed, wsum, scales, b, asymmetric)
                assert torch.equal(row[0], whole[i]), (k, n, i, (row[0] - whole[i]).abs().max().item())
            for m in range(1, amx_rows + 2):
                assert torch.equal(w8a8.w8a8_linear(x[:m].contiguous(), packed, wsum, scales, b, asymmetric),
                                   whole[:m]), (k, n, m)


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continuous_batching_gives_each_prompt_its_own_tokens(model, references, dtype) -> None:
    """Three prompts together, two more joining while they decode (their prefill shares steps
    with the others' decodes), the batch shrinking as they end: each its tokens alone, and their
    logprobs to the bit (every layer, the head too, computes a row the same way in any batch)."""
    llm = engine(model, dtype)
    llm_engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=24 - 3 * i, ignore_eos=True, logprobs=5)
              for i in range(len(PROMPTS))]
    for i in range(3):
        llm_engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, params[i])
    results, steps, widest = {}, 0, 0
    while llm_engine.has_unfinished_requests():
        if steps == 4:
            assert len(llm_engine.engine_core.scheduler.running) == 3
            for i in range(3, len(PROMPTS)):
                llm_engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, params[i])
        for out in llm_engine.step():
            results[out.request_id] = out
        widest = max(widest, len(llm_engine.engine_core.scheduler.running))
        llm_engine.engine_core.kv_cache_manager.check_integrity()
        steps += 1
    outputs = [results[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params] and widest == len(PROMPTS)
    assert_same([o.token_ids for o in outputs], references(dtype))
    for ours, alone in zip(outputs, references(dtype)):
        assert [{t: lp.logprob for t, lp in step.items()} for step in ours.logprobs] == \
            [{t: lp.logprob for t, lp in step.items()} for step in alone.logprobs[:len(ours.logprobs)]]


@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_prefill_gives_the_whole_prompts_tokens(model, alone, chunk) -> None:
    """Chunks of 8 rows (every chunk on VNNI, where the whole prompt of 25 or more rows takes
    AMX) and of 16 (AMX chunks, the last one often under 16), one prompt at a time and then all
    together (decodes share steps with chunks): the whole prompts' tokens."""
    llm = engine(model, max_num_batched_tokens=chunk)
    chunks = []
    execute = llm.llm_engine.engine_core.model_runner.execute_model

    def spy(sched):
        chunks.extend(n for n in sched.num_scheduled_tokens.values() if n > 1)
        assert sched.total_num_scheduled_tokens <= chunk
        return execute(sched)

    llm.llm_engine.engine_core.model_runner.execute_model = spy
    assert_same([o.token_ids for o in one_by_one(llm, PROMPTS)], alone)
    assert chunks.count(chunk) >= sum(n // chunk for n in PROMPT_LENS) - 1
    llm.reset_prefix_cache()
    assert_same(token_ids(run_checked(llm, token_prompts(PROMPTS), GREEDY)), alone)


def test_prefix_caching_reports_the_cached_tokens_and_keeps_the_tokens(model) -> None:
    """The first request leaves 64 tokens (four blocks) cached; the next two find them, and their
    tails after them, of 3 tokens (VNNI, where the whole prompt takes AMX) and of 17 (AMX), give
    what the whole prompts give without the cache."""
    prefix = PROMPTS[-1][:64]
    tails = ([5, 6, 7, 8] * 5, [9, 10, 11], [12, 13, 14, 15] * 4 + [16])
    prompts = [prefix + tail for tail in tails]
    expected = one_by_one(engine(model, enable_prefix_caching=False), prompts)
    llm = engine(model)
    outputs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in token_prompts(prompts)]  # one after another
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 64]
    assert llm.get_stats().prefix_cache_hit_tokens == 2 * 64
    assert_same(token_ids(outputs), expected)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive_drafts": False}  # fixed drafts, as tests/test_spec_decode.py takes them


@pytest.fixture(scope="module")
def one_layer(model, tmp_path_factory) -> str:
    """The model's first layer alone, its embedding and head (W8A8 too: a draft takes the target's
    quantization): a draft that agrees with it some of the time."""
    return str(first_layers(model, tmp_path_factory.mktemp("draft") / "one_layer", 1))


@pytest.mark.parametrize("draft", ["ngram", "self", "one_layer"])
def test_speculative_decoding_gives_plain_decodings_tokens(model, alone, one_layer, draft) -> None:
    """One request at a time, a step verifying 1 + 3 rows, then all five together (up to 20 rows
    a step: AMX): plain decoding's tokens. The model as its own draft (W8A8 as the target is)
    accepts its every draft; its first layer alone some."""
    config = NGRAM if draft == "ngram" else {"model": model if draft == "self" else one_layer,
                                              "num_speculative_tokens": 3, "adaptive_drafts": False}
    llm = engine(model, speculative_config=config)
    assert_same([o.token_ids for o in one_by_one(llm, PROMPTS)], alone)
    assert_same(token_ids(run_checked(llm, token_prompts(PROMPTS), GREEDY)), alone)
    stats = llm.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    if draft == "self":
        assert stats.spec_acceptance_rate == 1.0
        proposer = llm.llm_engine.engine_core.model_runner.proposer
        assert any(isinstance(getattr(m, "quant_method", None), W8A8Method) for m in proposer.model.modules())
    elif draft == "one_layer":
        assert stats.spec_acceptance_rate < 0.5


def kv_block_bytes(kind: str = "auto") -> int:
    """A 16-token block of the llama shape's cache: 2 layers, 2 KV heads of 24, float32 or 8-bit codes with a scale."""
    return 16 * 2 * 2 * 2 * (24 * 4 if kind == "auto" else 24 + 4)


def test_preemption_keeps_the_preempted_requests_tokens(model, alone) -> None:
    """12 blocks: the longest request alone needs 9 (110 + 24 tokens), all five together 26. The
    requests preempted after some output recompute their prompt and output (a prefill of a length
    they never had before) and go on with their tokens alone."""
    llm = engine(model, kv_cache_memory=12 * kv_block_bytes())
    scheduler = llm.llm_engine.engine_core.scheduler
    assert llm.llm_engine.engine_core.kv_cache_manager.num_blocks == 12
    preempt, victims = scheduler._preempt, []
    scheduler._preempt = lambda request: (victims.append((request.request_id, request.num_output_tokens)),
                                          preempt(request))[1]
    outputs = run_checked(llm, token_prompts(PROMPTS), GREEDY)
    assert scheduler.num_preemptions > 0 and any(n > 0 for _, n in victims), victims
    assert_same(token_ids(outputs), alone)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_kv_cache_keeps_its_tokens_through_batching_chunking_caching_and_preemption(model, kind) -> None:
    """W8A8 over an 8-bit cache: each prompt alone against all at once in a cache of 12 blocks
    (preempted), in chunks of 16 (prefix hits on the shared first prompts: tests/attention/
    test_kv_quant.py's check), the same tokens; and those tokens follow the float cache's where
    it does not hold a near tie (tests/test_gguf_features.py's MARGIN)."""
    prompts = PROMPTS + [PROMPTS[-1][:64] + [5, 6, 7], PROMPTS[-1][:80] + [8, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = one_by_one(engine(model, kv_cache_dtype=kind, enable_prefix_caching=False), prompts, params)
    stressed = engine(model, kv_cache_dtype=kind, max_num_batched_tokens=16, kv_cache_memory=12 * kv_block_bytes(kind))
    core = stressed.llm_engine.engine_core
    assert core.kv_cache_manager.num_blocks == 12
    assert_same(token_ids(run_checked(stressed, token_prompts(prompts), params)), expected)
    assert core.scheduler.num_preemptions > 0 and core.kv_cache_manager.prefix_stats.num_hit_tokens > 0
    float_cache = one_by_one(engine(model, enable_prefix_caching=False), prompts)
    assert_follows([o.token_ids for o in expected], float_cache)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_kv_perplexity_within_half_a_percent(model, kind) -> None:
    """tests/attention/test_kv_quant.py's bar, on the W8A8 model's own greedy texts (which it
    predicts well: a wrong cache shows there, where random tokens hide it), against its float cache."""
    base, quantized = own_text_perplexities(lambda **options: engine(model, **options), PROMPTS[:3], kind)
    assert base < VOCAB / 4  # the texts are the model's own
    assert abs(quantized / base - 1) < 0.005, (base, quantized)


# ---- mixtures of experts --------------------------------------------------------------------------------------------

MOE_PROMPTS = PROMPTS[:4]


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe", "olmoe"])
def test_moe_experts_run_w8a8_and_give_the_pytorch_references_tokens(family, tmp_path_factory, monkeypatch) -> None:
    """Every expert's gate_up and down projections are W8A8 layers (the router stays float) and run
    (each chosen expert takes its tokens' rows, a few of several requests: any count of rows); all
    prompts at once through the kernels give each prompt's tokens alone with every W8A8 layer on
    the PyTorch reference (w8a8_reference; the other ops as in the kernels' run, whose float
    rounding would otherwise move a code, and then a near tie)."""
    path = checkpoint(tmp_path_factory, family)
    # the Python layers, whose calls this counts (the native loop's experts are bit for bit these:
    # tests/test_native_layer_loop.py)
    llm = engine(path, native_layer_loop="off")
    model = llm.llm_engine.engine_core.model_runner.model
    moes = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    assert moes and all(isinstance(moe.gate.quant_method, UnquantizedLinearMethod) for moe in moes)
    experts = [linear for moe in moes for e in moe.experts for linear in (e.gate_up_proj, e.down_proj)]
    assert all(isinstance(linear.quant_method, W8A8Method) and linear.weight is None for linear in experts)
    rows = {id(linear): [] for linear in experts}
    whole_row_range = W8A8Method.whole_row_range  # every W8A8 layer call asks it (apply, apply_act_and_mul)

    def counting(self, layer, x):
        if id(layer) in rows:
            rows[id(layer)].append(x.shape[0])
        return whole_row_range(self, layer, x)

    monkeypatch.setattr(W8A8Method, "whole_row_range", counting)
    ours = token_ids(run_checked(llm, token_prompts(MOE_PROMPTS), GREEDY))
    ran = [r for r in rows.values() if r]
    assert len(ran) > len(experts) / 2 and len({n for r in ran for n in r}) > 10  # many experts, many row counts
    monkeypatch.setattr(W8A8Method, "whole_row_range", whole_row_range)
    reference = engine(path, native_layer_loop="off")
    for layer in w8a8_layers(reference):  # codes held unpacked, as off the CPU: each layer takes w8a8_reference
        layer.w8a8_codes = layer.quant_method.codes(layer).contiguous()
    assert_same(ours, one_by_one(reference, MOE_PROMPTS))


# ---- parallelism ----------------------------------------------------------------------------------------------------

def test_tp2_matches_tp1(model, alone, threaded) -> None:
    """Column-parallel layers (q/k/v, gate/up, the head) cut output channels, which W8A8 rounds
    alike on every rank; row-parallel ones (o_proj, down_proj) cut each row's inputs, and each rank
    rounds its slice by the whole row's range (gathered: W8A8Method.whole_row_range), so the ranks'
    codes are one rank's and only the float all-reduce of their partial outputs differs: the tokens
    (equal up to a near tie, as tests/test_gguf_features.py holds tensor parallelism) and their
    logprobs (within 1e-3 nats on average; a slice rounded by its own range moves them by 0.02)."""
    split = engine(model, enable_prefix_caching=False, tensor_parallel_size=2)
    ours = one_by_one(split, PROMPTS)
    assert threaded[0].group.calls > 0
    assert_follows([o.token_ids for o in ours], alone)
    differences = []
    for out, ref in zip(ours, alone):
        for i, (token, expected) in enumerate(zip(out.token_ids, ref.token_ids)):
            if token != expected:
                break
            differences.append(abs(out.logprobs[i][token].logprob - ref.logprobs[i][token].logprob))
    assert len(differences) > len(PROMPTS) * GREEDY.max_tokens / 2
    assert sum(differences) / len(differences) < 1e-3, max(differences)


def test_data_parallel_replicas_give_one_engines_tokens_and_route_by_prefix(model, alone) -> None:
    """Two replicas, each loading the checkpoint at W8A8 in a worker process of its own: all
    prompts at once give one engine's tokens; prompts sharing a prefix go, one at a time, to the
    replica that caches it."""
    config = EngineConfig.from_kwargs(model=model, dtype="float32", quantization="w8a8", kv_cache_memory=2**22,
                                      max_num_batched_tokens=256, data_parallel_size=2)
    test_data_parallel.check_replicas(config, PROMPTS, alone, assert_same)
