"""benchmarks/compute_peak.py and compare_peers' compute report: a workload's flops against what
transformers multiplies for the same tokens (counted by torch's FlopCounterMode), the attention
keys under sliding windows against a brute-force count, the probe's peak, and the ceilings."""
from __future__ import annotations

import pytest
import torch

from benchmarks.compute_peak import _attended_keys, ceiling, measure_peak, workload_flops
from benchmarks.peers.compute import compute_lines, compute_report
from dabba.arch.config import ArchConfig
from dabba.tools.bench.offline import OfflineWorkload


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_flops_are_what_transformers_multiplies(checkpoints, name) -> None:
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    ckpt = checkpoints[name]
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32, attn_implementation="eager")
    length = 37
    ids = torch.arange(length) % (model.config.vocab_size - 3) + 3
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids[None], logits_to_keep=1)  # the LM head for the last row only
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    ours = workload_flops(ArchConfig.from_hf(ckpt.path), OfflineWorkload(1, length, 1))
    assert ours["linear"] + ours["lm_head"] == counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
    # eager attention multiplies the whole square of scores (masked after); a window shorter than
    # the prompt saves work only in the count of keys a position truly attends
    if name != "gemma3":
        assert ours["attention"] == counts["aten.bmm"] * (length + 1) / (2 * length)


def test_windowed_keys_are_counted_position_by_position() -> None:
    for first, last, window in ((0, 50, None), (0, 50, 7), (10, 40, 16), (5, 6, 1)):
        brute = sum(min(t + 1, window or t + 1) for t in range(first, last))
        assert _attended_keys(first, last, window) == brute


def test_a_workload_counts_its_prefix_once_and_its_decodes() -> None:
    arch = ArchConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 8,
                                 "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "max_position_embeddings": 256})
    params = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)  # q, k, v, o, gate, up, down; head_dim 4
    flops = workload_flops(arch, OfflineWorkload(3, 10, 5, prefix_len=20))
    assert flops["linear"] == 2 * params * (20 + 3 * (10 + 4))
    assert flops["lm_head"] == 2 * 100 * 8 * 3 * 5
    keys = 20 * 21 // 2 + 3 * ((34 * 35 - 20 * 21) // 2)
    assert flops["attention"] == 2 * 4 * 2 * 4 * keys  # layers x (2 matmuls x 2 flops) x heads x head_dim


def test_the_probe_measures_a_peak_and_the_report_a_ceiling(checkpoints) -> None:
    peak = measure_peak(0.05)
    assert peak["threads"] == torch.get_num_threads()
    if peak["instruction"] is None:
        pytest.skip(f"no probe for the {peak['variant']} kernels")
    assert peak["peak_gflops"] > 0  # measured (its size depends on the machine and its load)
    path = str(checkpoints["llama"].path)
    peak = {**peak, "amx": False, "peak_gflops": 100.0}  # fixed, so the arithmetic below is exact
    medians = {"W1": {"dabba/bf16": {"total_tok_s": 50.0}, "vllm/bf16": {"total_tok_s": 40.0}},
               "W2": {"dabba/bf16": {"decode_tok_s": 9.0}}}
    report = compute_report(path, medians, peak)
    assert set(report) == {"W1"}  # only throughput workloads have a compute ceiling
    w1 = report["W1"]
    assert w1["seconds_at_peak"] == pytest.approx(w1["flops"]["total"] / 100e9)
    assert w1["total_tok_s_at_peak"] == pytest.approx(64 * (256 + 128) / w1["seconds_at_peak"])
    assert w1["share_of_peak"]["vllm/bf16"] == pytest.approx(40.0 / w1["total_tok_s_at_peak"])
    (line,) = compute_lines("tiny", report, peak)
    assert line.startswith("tiny W1: ") and "at 100 GFLOP/s" in line and "vllm/bf16" in line
    amx = {**peak, "amx": True}
    assert "seconds_at_peak" not in ceiling(ArchConfig.from_hf(path), OfflineWorkload(1, 8, 2), amx)
    assert compute_lines("tiny", compute_report(path, medians, amx), amx) == [
        f"tiny: no compute ceiling (AMX tiles outrun the {peak['instruction']} probe)"]
