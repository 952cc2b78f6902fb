"""`dabba plan`: the arithmetic against hand-computed values, and against what the engine allocates."""
from __future__ import annotations

import json

import pytest

from dabba import LLM
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main
from dabba.tools.plan import plan

SMOLLM = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
          "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "rope_theta": 100000.0}


def test_smollm_shape_by_hand(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM))  # the planner needs no weights
    p = plan(tmp_path, kv_cache_memory=2**30, max_model_len=2048)
    assert (p.num_layers, p.num_kv_heads, p.head_dim, p.p) == (30, 3, 64, 2)
    rows = {(r.quantization, r.kv_cache_dtype): r for r in p.rows}
    assert len(rows) == 9
    bf16 = rows["none", "auto"]
    assert bf16.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert bf16.kv_bytes_per_block == 23040 * 16
    assert bf16.num_blocks == 2**30 // 368640 == 2912
    assert bf16.max_sequences == 2912 // (2048 // 16) == 22
    int8_kv = rows["none", "int8"]
    assert int8_kv.kv_bytes_per_token == 2 * 30 * 3 * (64 * 1 + 4) == 12240  # codes plus a float32 scale per head
    assert int8_kv.num_blocks == 2**30 // (12240 * 16) == 5482 and int8_kv.max_sequences == 42
    # weights: tied embedding, per layer q/k/v/o, gate/up/down and two norms, a final norm; 2 bytes each
    per_layer = 576 * (576 + 192 + 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576 + 2 * 576
    assert bf16.weights_bytes == 2 * (49152 * 576 + 30 * per_layer + 576)
    # INT8: one byte per linear weight plus a bf16 scale per output row
    linear_outs = 576 + 192 + 192 + 576 + 2 * 1536 + 576
    linear_weights = per_layer - 2 * 576
    # both quantize the tied LM head to INT8 (a byte per weight, a bf16 scale per vocab row), and the
    # embedding reads its rows there: no bf16 vocabulary table
    lm_head = 49152 * 576 + 2 * 49152
    assert rows["int8", "auto"].weights_bytes == 2 * (30 * 2 * 576 + 576) + 30 * (
        linear_weights + 2 * linear_outs) + lm_head
    # INT4: half a byte per weight, a bf16 (scale, zero) per group of 64 (576 is not a multiple of 128), 128 for down
    groups = (576 // 64) * (576 + 192 + 192 + 576 + 2 * 1536) + (1536 // 128) * 576
    assert rows["int4", "auto"].weights_bytes == 2 * (30 * 2 * 576 + 576) + 30 * (
        linear_weights // 2 + groups * 2 * 2) + lm_head


def test_mixture_of_experts_counts_total_and_active_parameters(tmp_path) -> None:
    """OLMoE-1B-7B's shape: 64 experts of intermediate 1024, 8 a token, in all 16 layers; q/k norms
    over the whole projection. Every expert's bytes are in the weights; a token multiplies 8 of 64."""
    cfg = {"architectures": ["OlmoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 1024,
           "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 50304,
           "num_experts": 64, "num_experts_per_tok": 8, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan(tmp_path, kv_cache_memory=2**30, max_model_len=4096)
    attention = 4 * 2048 * 2048 + 2048 + 2048  # q, k, v, o and the two q/k norms
    per_layer = attention + 2048 * 64 + 64 * 3 * 2048 * 1024 + 2 * 2048  # router, experts, two norms
    total = 2 * 50304 * 2048 + 16 * per_layer + 2048
    assert p.parameters == total and 6.9e9 < total < 7.0e9
    assert p.active_parameters == total - 16 * (64 - 8) * 3 * 2048 * 1024 and 1.2e9 < p.active_parameters < 1.3e9
    assert p.experts == "8 of 64 experts in 16 of 16 layers"
    assert p.rows[0].quantization == "none" and p.rows[0].weights_bytes == 2 * total
    assert "parameters: 6919.2M, 1282.0M active per token (8 of 64 experts in 16 of 16 layers)" in p.render()
    int4 = plan(tmp_path, kv_cache_memory=2**30, quantization="int4", kv_cache_dtype="auto").rows[0]
    expert_codes = 16 * 64 * 3 * 2048 * 1024 // 2  # half a byte per expert weight; the router stays bf16
    assert expert_codes < int4.weights_bytes < 0.3 * 2 * total


def test_demo_shape_by_hand_with_a_total_budget() -> None:
    p = plan(DEMO_MODEL, kv_cache_memory=None, total_memory=64 * 2**20, kv_cache_dtype="fp8")
    assert p.formula.startswith("2 · B · S · L · n_kv_heads · head_dim · p = 2 · B · S · 6 · 2 · 64 · 2 = 3072")
    for row in p.rows:
        assert row.kv_bytes_per_token == 2 * 6 * 2 * 68
        assert row.kv_cache_memory == 64 * 2**20 - row.weights_bytes
        assert row.num_blocks == row.kv_cache_memory // (16 * 1632)
        assert row.max_sequences == row.num_blocks // (512 // 16)
    assert [r.max_sequences for r in p.rows] == sorted(r.max_sequences for r in p.rows)  # smaller weights, more room


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_plan_equals_what_the_engine_allocates(quantization, kv_cache_dtype) -> None:
    budget = 48 * 2**20 + 12345
    row, = plan(DEMO_MODEL, budget, quantization=quantization or "none", kv_cache_dtype=kv_cache_dtype).rows
    engine = LLM(DEMO_MODEL, quantization=quantization, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget).llm_engine
    assert row.weights_bytes == engine.engine_core.model_runner.weight_bytes
    assert row.num_blocks == engine.engine_core.cache_layout.num_blocks
    assert row.kv_bytes_per_block == engine.engine_core.cache_layout.bytes_per_block
    kv_caches = engine.engine_core.model_runner.kv_caches
    allocated = sum(sum(t.nbytes for t in (c if isinstance(c, tuple) else (c,))) for c in kv_caches)
    assert allocated == row.num_blocks * row.kv_bytes_per_block


def test_plan_of_a_tensor_parallel_rank_equals_what_the_engine_allocates() -> None:
    budget = 24 * 2**20 + 777  # each rank's
    whole, = plan(DEMO_MODEL, budget, quantization="none", kv_cache_dtype="auto").rows
    rank, = plan(DEMO_MODEL, budget, quantization="none", kv_cache_dtype="auto", tensor_parallel_size=2).rows
    assert rank.kv_bytes_per_block * 2 == whole.kv_bytes_per_block  # one of the demo's 2 KV heads
    assert whole.weights_bytes / 2 < rank.weights_bytes < whole.weights_bytes  # norms are whole on every rank
    engine = LLM(DEMO_MODEL, kv_cache_memory=budget, tensor_parallel_size=2).llm_engine
    try:
        assert (rank.num_blocks, rank.kv_bytes_per_block) == (engine.engine_core.cache_layout.num_blocks,
                                                             engine.engine_core.cache_layout.bytes_per_block)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads"):
        plan(DEMO_MODEL, budget, tensor_parallel_size=4)


def test_plan_of_prequantized_checkpoints(checkpoints, tmp_path) -> None:
    ckpt = checkpoints["qwen2"]  # q/k/v biases
    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:30_000])
    for method, flags in (("gptq", []), ("gptq", ["--act-order"]), ("awq", [])):
        out = tmp_path / f"{method}{len(flags)}"
        assert main(["quantize", str(ckpt.path), str(out), "--method", method, "--group-size", "32", "--calibration",
                     str(calib), "--num-samples", "4", "--seq-len", "64", *flags]) == 0
        row, = plan(out, 2**20, kv_cache_dtype="auto", dtype="float32").rows
        assert row.quantization == method
        runner = LLM(str(out), dtype="float32", kv_cache_memory=2**20).llm_engine.engine_core.model_runner
        assert row.weights_bytes == runner.weight_bytes


def test_plan_cli(capsys) -> None:
    assert main(["plan", DEMO_MODEL, "--kv-cache-memory", "1GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_memory"] == 2**30 and len(out["rows"]) == 9
    assert main(["plan", DEMO_MODEL, "--quantization", "int4", "--kv-cache-dtype", "int8"]) == 0
    text = capsys.readouterr().out
    assert "2 · B · S · 6 · 2 · 64 · 2" in text and "int4" in text


def test_load_time_is_the_formula_of_rates_measured_here() -> None:
    result = plan(DEMO_MODEL, 16 * 2**20, quantization="none", kv_cache_dtype="auto", load_time=True)
    (row,) = result.rows
    rates = result.load_rates
    assert set(rates) == {"fixed", "read", "zero", "process_none"} and all(v > 0 for v in rates.values())
    files = sum(f.stat().st_size for f in __import__("pathlib").Path(DEMO_MODEL).glob("*.safetensors"))
    want = (rates["fixed"] + files / rates["read"] + files / rates["process_none"]
            + row.num_blocks * row.kv_bytes_per_block / rates["zero"])
    assert row.load_seconds == pytest.approx(want)
    assert "load s" in result.render()
    assert plan(DEMO_MODEL, 16 * 2**20).rows[0].load_seconds is None  # only when asked: it reads the files


def test_a_router_plans_what_dabba_plan_counts(checkpoints) -> None:
    """The footprint a server of several models plans each load by is the planner's row, and the
    KV budget it makes explicit is what the engine then allocates."""
    from dabba.config import EngineConfig
    from dabba.engine.llm_engine import LLMEngine
    from dabba.engine.model_footprint import plan_footprint

    path = str(checkpoints["qwen2"].path)
    footprint, config = plan_footprint(EngineConfig.from_kwargs(model=path, quantization="int8", max_num_seqs=4))
    (row,) = plan(path, footprint.kv_cache_bytes, quantization="int8", kv_cache_dtype="auto").rows
    assert footprint.weights_bytes == row.weights_bytes
    assert footprint.kv_cache_bytes == row.num_blocks * row.kv_bytes_per_block == config.cache_config.kv_cache_memory
    engine = LLMEngine(config)
    assert engine.engine_core.cache_layout.num_blocks == row.num_blocks
    engine.shutdown()
