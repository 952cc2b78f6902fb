"""`dabba quantize`: layer-by-layer GPTQ/RTN into GPTQ's layout, loaded back by the engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dabba import LLM, SamplingParams
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main
from dabba.tools.evaluation import perplexity


def test_tiny_checkpoint_round_trip(checkpoints, tmp_path, capsys) -> None:
    ckpt = checkpoints["qwen2"]  # q/k/v biases travel with the quantized shards
    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:30_000])
    assert main(["quantize", str(ckpt.path), str(tmp_path / "q"), "--group-size", "32", "--calibration", str(calib),
                 "--num-samples", "8", "--seq-len", "64", "--act-order"]) == 0
    config = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantization_config"]
    assert config["quant_method"] == "gptq" and config["desc_act"] is True
    llm = LLM(str(tmp_path / "q"), dtype="float32")
    out = llm.generate({"prompt_token_ids": ckpt.prompts[4]}, SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_gptq_is_closer_to_full_precision_than_rtn_on_the_demo_model(demo_quantized) -> None:
    text = Path(DEMO_MODEL, "heldout.txt").read_text()
    text = text[: len(text) // 3]  # ~28k tokens: GPTQ's gap to RTN is the same share as on the whole file
    base = perplexity(LLM(DEMO_MODEL), text, 256, 128).perplexity
    gptq = perplexity(LLM(str(demo_quantized["gptq"])), text, 256, 128).perplexity
    rtn = perplexity(LLM(str(demo_quantized["rtn"])), text, 256, 128).perplexity
    assert base < gptq < rtn, (base, gptq, rtn)
    assert (gptq - base) < 0.6 * (rtn - base), (base, gptq, rtn)


def test_quantize_refuses_a_quantized_checkpoint(tmp_path) -> None:
    main(["quantize", DEMO_MODEL, str(tmp_path / "q"), "--method", "rtn", "--num-samples", "4"])
    with pytest.raises(ValueError, match="already quantized"):
        from dabba.tools.quantize import QuantizeOptions, quantize_checkpoint

        quantize_checkpoint(tmp_path / "q", tmp_path / "qq", "x " * 1000, QuantizeOptions())


@pytest.mark.parametrize("name, samples", [("mixtral", 4), ("qwen3moe", 1)])
def test_moe_checkpoint_round_trip(checkpoints, tmp_path, capsys, name, samples) -> None:
    """GPTQ per expert, each on the tokens the router sends it; an expert that calibration never
    reaches (one 16-token window over Qwen3-MoE's 8 experts, top-3) is rounded to nearest, and
    the config counts its projections. The router stays in the checkpoint's precision, the experts
    keep the family's names (Mixtral's w1/w3/w2), and the engine loads and runs the result."""
    from safetensors import safe_open

    ckpt = checkpoints[name]
    calib = tmp_path / "calib.txt"
    calib.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:30_000])
    assert main(["quantize", str(ckpt.path), str(tmp_path / "q"), "--group-size", "32", "--calibration",
                 str(calib), "--num-samples", str(samples), "--seq-len", "16" if samples == 1 else "64"]) == 0
    config = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["quantization_config"]
    assert (config["dabba_rtn_projections"] > 0) == (name == "qwen3moe")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        block, gate = ("block_sparse_moe", "w1") if name == "mixtral" else ("mlp", "gate_proj")
        assert f"model.layers.0.{block}.gate.weight" in names  # the router, unquantized
        assert f"model.layers.0.{block}.experts.5.{gate}.qweight" in names
        assert not any(k.endswith(f"experts.5.{gate}.weight") for k in names)
    llm = LLM(str(tmp_path / "q"), dtype="float32")
    out = llm.generate({"prompt_token_ids": ckpt.prompts[4]}, SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
