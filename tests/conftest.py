"""Tiny random-weight checkpoints of every supported family, written with `transformers` into a
temporary directory once per session, plus greedy references computed by `transformers`."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dabba import LLM, SamplingParams
from dabba.outputs import RequestOutput
from tools.tiny_checkpoint import make_checkpoint

PHI3_FACTORS = [1.714, 2.633, 2.11, 2.812, 2.877, 1.197, 1.04, 3.512, 1.778, 1.703, 3.987, 2.411]
# Odd shapes on purpose: head_dim not 64, GQA ratios 1, 2 and 4, tied and untied, rope scaling.
CHECKPOINTS = {
    "llama": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # A sliding window of 40 keys, shorter than most prompts + outputs (up to 364 tokens), not a
    # multiple of the 16-token block: every layer attends only within it (transformers' sdpa
    # and eager masks agree on it; test_parity checks the window changes the reference).
    "mistral": dict(arch="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    tie_word_embeddings=True, max_shard_size="200KB", sliding_window=40),
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen3": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Phi-4-mini's shape in small: fused qkv/gate_up tensors, 3/4 of each head rotates (24 of 32 dims),
    # longrope past an original window of 64 (attention factor sqrt(1 + ln 8 / ln 64)), a sliding
    # window of 448 that covers the tests' sequences. max_model_len 512 > 64: the long factors. Short
    # and long factors are equal: transformers switches between them by a sequence's current length,
    # dabba picks one per engine (tests/test_phi3.py tests each against transformers).
    "phi3": dict(arch="Phi3ForCausalLM", num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                 tie_word_embeddings=False, original_max_position_embeddings=64, sliding_window=448,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": PHI3_FACTORS, "long_factor": PHI3_FACTORS}),
    # Gemma 2: GeGLU, (1 + w) norms (perturbed from the identity) around both sublayers, scaled
    # embeddings, attention scale 20 ** -0.5 (not head_dim's), soft caps small enough to bite
    # (test_gemma checks each changes transformers' output), layers 0 and 2 sliding within 40 keys
    # (not a multiple of the 16-token block), untied.
    "gemma2": dict(arch="Gemma2ForCausalLM", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=24, query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   sliding_window=40, tie_word_embeddings=False, norm_std=0.3),
    # Gemma 3 (text): q/k norms, 4 layers of which the third is global (sliding_window_pattern 3),
    # the sliding ones with their own RoPE base (10^4) and the global one 10^6 with linear scaling
    # (as Gemma 3 4B+), GQA 3:1, tied.
    "gemma3": dict(arch="Gemma3ForCausalLM", num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
                   head_dim=32, query_pre_attn_scalar=48, sliding_window=40, sliding_window_pattern=3,
                   tie_word_embeddings=True, norm_std=0.3,
                   rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Mixtures of experts, more experts than each token takes so routing matters: Mixtral (6 experts,
    # top-2, renormalised), Qwen3-MoE (8, top-3, renormalised, per-head q/k norms, layer 1 dense
    # through mlp_only_layers, GQA 4:1), OLMoE (8, top-4, not renormalised, q/k norms over the
    # whole projection).
    "mixtral": dict(arch="MixtralForCausalLM", num_local_experts=6, num_experts_per_tok=2, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "qwen3moe": dict(arch="Qwen3MoeForCausalLM", num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                     moe_intermediate_size=64, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "olmoe": dict(arch="OlmoeForCausalLM", num_experts=8, num_experts_per_tok=4, intermediate_size=48,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=24),
}
# A wider init than transformers' default 0.02 makes the next token depend strongly on context,
# so a wrong position, mask or block would change the greedy output.
INIT_STD = 0.1

PROMPT_LENS = (1, 2, 7, 16, 17, 33, 64, 100, 191, 300)
NUM_NEW_TOKENS = 64


@dataclass
class Checkpoint:
    name: str
    path: Path
    prompts: list[list[int]]  # token ids; the last two share a 150-token prefix with prompt 8
    reference: list[list[int]]  # transformers' greedy continuation of each prompt


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    shared = prompts[8][:150]
    prompts.append(shared + torch.randint(3, vocab_size, (40,), generator=g).tolist())
    prompts.append(shared + torch.randint(3, vocab_size, (5,), generator=g).tolist())
    return prompts


def hf_greedy(model, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding to perturb the reference
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, eos_token_id=None,
                                 pad_token_id=2)
            out.append(ids[0, len(p):].tolist())
    return out


# A suite run in a subprocess (tests/test_kernel_variants.py) takes its parent's checkpoints and
# references from this JSON file rather than making them and running transformers again.
SHARED_CHECKPOINTS_ENV = "DABBA_TEST_CHECKPOINTS"


def share_checkpoints(checkpoints: dict[str, Checkpoint], path: Path) -> dict[str, str]:
    """Write the checkpoints for a subprocess; the environment entry that points it there."""
    path.write_text(json.dumps({name: {"path": str(c.path), "prompts": c.prompts, "reference": c.reference}
                                for name, c in checkpoints.items()}))
    return {SHARED_CHECKPOINTS_ENV: str(path)}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    from transformers import AutoModelForCausalLM

    if shared := os.environ.get(SHARED_CHECKPOINTS_ENV):
        return {name: Checkpoint(name, Path(c["path"]), c["prompts"], c["reference"])
                for name, c in json.loads(Path(shared).read_text()).items()}
    result = {}
    for name, spec in CHECKPOINTS.items():
        spec = dict(spec)
        path = make_checkpoint(tmp_path_factory.mktemp(name), spec.pop("arch"), initializer_range=INIT_STD, **spec)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = make_prompts(model.config.vocab_size)
        result[name] = Checkpoint(name, path, prompts, hf_greedy(model, prompts, NUM_NEW_TOKENS))
    return result


@pytest.fixture(scope="session")
def gguf_sources(checkpoints, tmp_path_factory) -> dict[str, Checkpoint]:
    """Each family's checkpoint as a GGUF file can hold it (tests/gguf_families.py)."""
    from tests.gguf_families import make_gguf_sources

    return make_gguf_sources(checkpoints, tmp_path_factory)


@pytest.fixture(params=sorted(CHECKPOINTS))
def checkpoint(request, checkpoints) -> Checkpoint:
    return checkpoints[request.param]


@pytest.fixture
def dabba_log():
    """Records dabba's log lines (its logger does not propagate to the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("dabba")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def run_checked(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    """Drive the engine step by step, checking the KV cache's integrity after every step and
    that every block is free once all requests are done. Outputs come back in input order."""
    engine = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
        engine.engine_core.kv_cache_manager.check_integrity()
    kv = engine.engine_core.kv_cache_manager
    assert kv.pool.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    assert not engine.engine_core.kv_cache_manager.req_to_blocks
    assert not engine.output_processor.parents and not engine.output_processor.sample_of, "outputs state leaked"
    # the worker forgets finished requests at the next step; none but these (or their n samples)
    assert {r.split("#")[0] for r in engine.engine_core.model_runner.requests.states} <= set(ids)
    return [results[r] for r in ids]


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def own_text_perplexities(make_engine, prompts: list[list[int]], kv_cache_dtype: str) -> tuple[float, float]:
    """The perplexity of a model's own greedy continuations of ``prompts`` (120 tokens: text it
    predicts well, where a wrong KV cache shows and random tokens would hide it), prefilled whole
    with a float cache and with ``kv_cache_dtype``. ``make_engine(**options)`` builds the LLM."""
    import math

    from dabba import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    texts = [p + out.outputs[0].token_ids
             for p, out in zip(prompts, make_engine().generate(token_prompts(prompts), greedy, use_tqdm=False))]

    def perplexity(dtype: str) -> float:
        outs = make_engine(kv_cache_dtype=dtype).generate(
            token_prompts(texts), SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        nll = [-d[t].logprob for text, out in zip(texts, outs) for d, t in zip(out.prompt_logprobs[1:], text[1:])]
        return math.exp(sum(nll) / len(nll))

    return perplexity("auto"), perplexity(kv_cache_dtype)


def quotation_prompts(lengths: tuple[int, ...], vocab: int, lowest: int = 2) -> list[list[int]]:
    """Random tokens in [lowest, vocab) whose second half repeats spans of the first, as quotations
    do: n-gram lookups (speculative decoding's) find them."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = []
    for n in lengths:
        head = torch.randint(lowest, vocab, (n - n // 2,), generator=g).tolist()
        span = head[: max(3, n // 6)]
        prompts.append((head + span * n)[:n])
    return prompts
