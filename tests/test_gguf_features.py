"""Every engine feature on a quantized GGUF model (tests/gguf_writer.py: a small Llama of random
blocks), end to end against the same model with the feature off: continuous batching, prefix
caching, chunked prefill, speculative decoding (n-gram, GGUF drafts), structured outputs,
tensor and data parallelism, the 8-bit KV caches. Two files: the writer's seven-type mix, and a
Q4_K_M-like file of K types only; both with a Q4_K token embedding and a Q6_K LM head, as
Q4_K_M files hold them.

Greedy tokens are equal (``assert_same``) where every row takes the kernel it takes in the
reference. A step of up to gguf_gemv_max_rows rows (8, more in the avx2 build)
runs the GEMV, which rounds activations to 8-bit codes, and a longer one a GEMM with the
activations rounded to the same codes (in integers on AVX512-VNNI without AMX, on dequantized
weights elsewhere: quantization/gguf.py), so a row's logits do not depend on how many rows share
its step but for float32 summation order. Where a feature changes
that order (steps that mix rows otherwise than the reference's, tensor parallelism's all-reduce,
another attention backend over an 8-bit cache) a code can move by one, and the tokens are held by
``assert_follows``: equal up to a position where the reference's top one and the token picked
instead lie within the bar that tests/test_gguf_quantized.py sets."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from dabba import LLM, SamplingParams
from dabba.config import EngineConfig
from dabba.ops import native
from dabba.outputs import CompletionOutput
from dabba.structured_output import StructuredOutputsParams
from tests.conftest import own_text_perplexities, quotation_prompts, run_checked, token_prompts
from tests.distributed import test_data_parallel, test_tensor_parallel
from tests.gguf_writer import HIDDEN, LINEAR_TYPES, VOCAB, write_llama
from tests.test_gguf_quantized import top_two

threaded = test_tensor_parallel.threaded  # LLM(tensor_parallel_size=2) runs its ranks as threads here

MARGIN = 0.1  # nats: tokens a reference holds this close to its top one are near ties, any the model's pick
# Q4_K_M's types, but attn_k in Q6_K: random Q4_K blocks (tools/random_gguf.py) give each 32-value
# sub-block a random mean (codes 0-15 less a random min), and keys of such an attn_k come out ~17x
# larger than a zero-mean type's, their attention far sharper than a trained model's: an 8-bit
# cache then moves even the F32 twin's perplexity by over 1%.
K_QUANTS = {**{name: "Q4_K" for name in LINEAR_TYPES}, "attn_k": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}
TABLES = {"embedding": "Q4_K", "head": "Q6_K"}
MODELS = {"mixed": TABLES, "k_quants": {"types": K_QUANTS, **TABLES}}
# Row-parallel layers (attn_output, ffn_down) cut their input columns in whole blocks: 256 hidden
# inputs make 128 a rank, less than a K type's 256-value super-block; 512 ffn inputs split.
SPLITTABLE = {**LINEAR_TYPES, "attn_output": "Q4_1", "ffn_down": "Q6_K"}

# Chunks of 16 leave every prompt's last chunk over decode's 8 rows (9, 16 + 9, ..., 6 x 16 + 14).
PROMPT_LENS = (9, 25, 41, 64, 110)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


PROMPTS = quotation_prompts(PROMPT_LENS, VOCAB)  # n-gram lookups find spans of them


def engine(path: str, **options) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=2**22, **options)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_same(ours: list[list[int]], reference: list[CompletionOutput]) -> None:
    """Each greedy output is the reference's (as long as it runs: a request may stop sooner)."""
    assert [list(t) for t in ours] == [list(r.token_ids[:len(t)]) for t, r in zip(ours, reference)]
    assert len(ours) == len(reference) and all(len(t) > 0 for t in ours)


def assert_follows(ours: list[list[int]], reference: list[CompletionOutput]) -> None:
    """Each greedy output is the reference's, or is up to a position where the reference holds
    its token within MARGIN nats of its own top one (among its top five)."""
    assert len(ours) == len(reference)
    for n, (tokens, ref) in enumerate(zip(ours, reference)):
        assert len(tokens) <= len(ref.token_ids), f"output {n} is longer than its reference"
        for i, (token, expected) in enumerate(zip(tokens, ref.token_ids)):
            if token != expected:
                logprobs = {t: lp.logprob for t, lp in ref.logprobs[i].items()}
                assert token in logprobs and logprobs[expected] - logprobs[token] <= MARGIN, (
                    f"output {n}, position {i}: {token} against {expected}, the reference's top ones {logprobs}")
                break


@pytest.fixture(scope="module", params=list(MODELS))
def model(tmp_path_factory, request) -> str:
    return write_llama(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", **MODELS[request.param])


@pytest.fixture(scope="module")
def alone(model) -> list[CompletionOutput]:
    """Each prompt's greedy output run alone, without prefix caching: the reference."""
    llm = engine(model, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in token_prompts(PROMPTS)]


@pytest.fixture(scope="module")
def splittable(tmp_path_factory) -> str:
    return write_llama(tmp_path_factory.mktemp("gguf") / "splittable.gguf", types=SPLITTABLE, **TABLES)


def test_continuous_batching_gives_each_prompt_its_own_tokens(model, alone) -> None:
    """Three prompts together, two more joining while they decode (their prefill shares steps
    with the others' decodes: those run through the GEMM), the batch shrinking as they end: steps
    whose rows are not the reference's, held by ``assert_follows``."""
    llm = engine(model)
    llm_engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=24 - 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    for i in range(3):
        llm_engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, params[i])
    results, steps = {}, 0
    while llm_engine.has_unfinished_requests():
        if steps == 4:
            assert len(llm_engine.engine_core.scheduler.running) == 3
            for i in range(3, len(PROMPTS)):
                llm_engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, params[i])
        for out in llm_engine.step():
            results[out.request_id] = out
        llm_engine.engine_core.kv_cache_manager.check_integrity()
        steps += 1
    outputs = [results[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]
    assert [len(o) for o in outputs] == [p.max_tokens for p in params]
    assert_follows(outputs, alone)


def test_prefix_caching_reports_the_cached_tokens_and_keeps_the_tokens(model) -> None:
    """The first request leaves 64 tokens (four blocks) cached; the next two find them, and their
    tails after them, of 3 tokens (through the GEMV, where the whole prompt takes the GEMM) and
    of 11 (the GEMM), give what the whole prompts give without the cache."""
    prefix = PROMPTS[-1][:64]
    tails = ([5, 6, 7, 8] * 5, [9, 10, 11], [12, 13, 14, 15] * 2 + [16, 17, 18])
    prompts = token_prompts([prefix + tail for tail in tails])
    uncached = engine(model, enable_prefix_caching=False)
    expected = [uncached.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]
    llm = engine(model)
    outputs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]  # one after another
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 64]
    assert llm.get_stats().prefix_cache_hit_tokens == 2 * 64
    assert_same(token_ids(outputs), expected)


def test_chunked_prefill_gives_the_whole_prompts_tokens(model, alone) -> None:
    """16-token chunks, one prompt at a time, then all together (decodes share steps with chunks).
    Where the GEMV stops at 8 rows (AMX tiles) every chunk is a GEMM, as the whole prompt is, and
    the tokens are the same; without, the chunks take the GEMV's passes, the whole prompt up to 64
    rows too but the longest the GEMM, and the tokens follow."""
    llm = engine(model, max_num_batched_tokens=16)
    chunks = []
    execute = llm.llm_engine.engine_core.model_runner.execute_model

    def spy(sched):
        chunks.extend(n for n in sched.num_scheduled_tokens.values() if n > 1)
        assert sched.total_num_scheduled_tokens <= 16
        return execute(sched)

    llm.llm_engine.engine_core.model_runner.execute_model = spy
    one_by_one = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in token_prompts(PROMPTS)]
    assert chunks.count(16) >= sum(n // 16 for n in PROMPT_LENS) - 1 and min(chunks) > 8
    check = assert_same if native.gguf_gemv_max_rows(HIDDEN) < min(chunks) else assert_follows
    check(one_by_one, alone)
    llm.reset_prefix_cache()
    check(token_ids(run_checked(llm, token_prompts(PROMPTS), GREEDY)), alone)


def test_prefill_in_chunks_of_8_rows_stays_within_the_quantization_bar(model) -> None:
    """Chunks of up to 8 rows take the GEMV, the whole prompt the GEMM, both on the same 8-bit
    codes of the activations; but attention over a prompt in chunks sums in another order, which
    can move a code by one: teacher forced over 109 positions, the top token is the whole
    prompt's wherever its top two lie more than MARGIN apart, and its logprob differs little on
    average (tests/test_gguf_quantized.py's bar against the dequantized weights)."""
    llm = engine(model, max_num_batched_tokens=8)
    chunks = []
    execute = llm.llm_engine.engine_core.model_runner.execute_model
    llm.llm_engine.engine_core.model_runner.execute_model = lambda sched: (
        chunks.append(sched.total_num_scheduled_tokens), execute(sched))[1]
    gemv, whole = top_two(llm, PROMPTS[-1]), top_two(engine(model), PROMPTS[-1])
    assert max(chunks) == 8 and len(chunks) == math.ceil(len(PROMPTS[-1]) / 8)
    decided = [i for i, ref in enumerate(whole) if ref[0][1] - ref[1][1] > MARGIN]
    assert len(decided) > len(whole) / 3
    assert all(gemv[i][0][0] == whole[i][0][0] for i in decided)
    differences = [abs(q[0][1] - r[0][1]) for q, r in zip(gemv, whole)]
    assert sum(differences) / len(differences) < 0.05


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive_drafts": False}  # fixed drafts, as tests/test_spec_decode.py takes them


@pytest.fixture(scope="module")
def one_layer(model, tmp_path_factory) -> str:
    """The model's first layer alone, its embedding and head: a draft that agrees with it some of the time."""
    return write_llama(tmp_path_factory.mktemp("draft") / "one_layer.gguf", layers=1, **MODELS[Path(model).stem])


@pytest.mark.parametrize("draft", ["ngram", "self", "one_layer"])
def test_speculative_decoding_gives_plain_decodings_tokens(model, alone, one_layer, draft) -> None:
    """One request at a time: a step verifies 1 + 3 rows, within the GEMV as a plain decode, but
    a draft prefills the prompt with the first token sampled from it, one row more than the
    target's prefill, and that row can take the other kernel (held by ``assert_follows``). The
    model as its own draft accepts nearly every draft (all but where that moved a near tie), as a
    dense model's does; its first layer alone some (tests/test_spec_decode_draft.py's two drafts)."""
    config = NGRAM if draft == "ngram" else {"model": model if draft == "self" else one_layer,
                                              "num_speculative_tokens": 3, "adaptive_drafts": False}
    llm = engine(model, speculative_config=config)
    outputs = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in token_prompts(PROMPTS)]
    assert_follows(outputs, alone)
    stats = llm.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    if draft == "self":
        assert stats.spec_acceptance_rate >= 0.95
    elif draft == "one_layer":
        assert stats.spec_acceptance_rate < 0.5


# The vocabulary is "t0" ... "t297": constraints built of whole tokens (a token that a constraint
# could cut, "t1" of "t10", would leave the grammar no token to go on with). No JSON: no token
# holds a brace or a quote.
CHOICES = ["t5", "t7t9", "t3t3t8"]
REGEX = r"t[1-9](t[0-9]){1,3}"
GRAMMAR = 'root ::= "t1" ("t2" | "t4t6"){1,3}'


def test_structured_outputs_satisfy_their_constraints(model) -> None:
    llm = engine(model)
    settings = [(None, 0.0), (1, 0.8), (2, 1.3)]
    cases = [(dict(choice=CHOICES), lambda text: text in CHOICES),
             (dict(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
             (dict(grammar=GRAMMAR), lambda text: re.fullmatch(r"t1(t2|t4t6){1,3}", text))]
    params, checks = [], []
    for seed, temperature in settings:
        for fields, check in cases:
            params.append(SamplingParams(max_tokens=20, temperature=temperature, seed=seed,
                                         structured_outputs=StructuredOutputsParams(**fields)))
            checks.append(check)
    outputs = run_checked(llm, token_prompts([PROMPTS[i % len(PROMPTS)] for i in range(len(params))]), params)
    for out, check in zip(outputs, checks):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and check(completion.text), (completion.text,
                                                                              completion.finish_reason)


def test_tp2_matches_tp1(splittable, threaded) -> None:
    """Column-parallel layers cut rows of blocks (Q4_K q, Q5_0 k, Q6_K v, Q4_0 gate, Q8_0 up, the
    Q6_K head's vocabulary), row-parallel ones whole blocks of columns (Q4_1 attn_output, 128 of
    256 inputs a rank; Q6_K ffn_down, one 256-value super-block of 512)."""
    whole = engine(splittable, enable_prefix_caching=False)
    expected = [whole.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in token_prompts(PROMPTS)]
    split = engine(splittable, enable_prefix_caching=False, tensor_parallel_size=2)
    assert_follows([split.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in token_prompts(PROMPTS)],
                   expected)
    assert threaded[0].group.calls > 0


def test_a_split_inside_a_block_is_refused(model, threaded) -> None:
    """Both files' attn_output is a K type of 256 inputs: at tp=2 a rank would take half a
    super-block; refused as a quantization group split is (layers/linear.py), naming the layer."""
    with pytest.raises(ValueError, match=r"o_proj: tensor_parallel_size=2 puts a shard boundary inside a "
                                         r"quantization group \(128 of 256 input channels a rank, groups of 256\)"):
        engine(model, tensor_parallel_size=2)


def test_data_parallel_replicas_give_one_engines_tokens_and_route_by_prefix(splittable) -> None:
    """Two replicas, each loading the file in a worker process of its own: all prompts at once
    follow one engine's tokens (a replica's steps mix the prompts' rows otherwise than the
    reference's one at a time); prompts sharing a prefix go, one at a time, to the replica that
    caches it."""
    reference = engine(splittable, enable_prefix_caching=False)
    expected = [reference.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in token_prompts(PROMPTS)]
    config = EngineConfig.from_kwargs(model=splittable, dtype="float32", kv_cache_memory=2**22,
                                      max_num_batched_tokens=256, data_parallel_size=2)
    test_data_parallel.check_replicas(config, PROMPTS, expected, assert_follows)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8bit_kv_cache_on_the_native_backend_follows_the_reference_backend(model, kind) -> None:
    """tests/attention/test_kv_quant.py's engine check: the native backend and layer loop
    against the reference backend and the Python layers, the same 8-bit cache."""
    outputs = []
    for backend in ("auto", "torch_ref"):
        llm = engine(model, kv_cache_dtype=kind, attention_backend=backend)
        assert (llm.llm_engine.engine_core.model_runner.native_loop is not None) == (backend == "auto")
        outputs.append(run_checked(llm, token_prompts(PROMPTS), GREEDY))
    assert_follows(token_ids(outputs[0]), [o.outputs[0] for o in outputs[1]])


def test_int8_kv_perplexity_within_half_a_percent(model) -> None:
    """tests/attention/test_kv_quant.py's bar, in its regime (dabba.tools.evaluation.perplexity
    prefills each window whole: on a GGUF model the GEMM), on the model's own greedy texts, which
    it predicts well (a wrong cache shows there, where random tokens hide it)."""
    base, int8 = own_text_perplexities(lambda **options: engine(model, **options), PROMPTS[:3], "int8")
    assert base < VOCAB / 4  # the texts are the model's own
    assert abs(int8 / base - 1) < 0.005, (base, int8)
