"""benchmarks/compare_peers.py without peers installed: its model list, KV budgets, targets, memory
meter and report; and dabba's side of W2 run through `dabba bench latency` in fresh processes,
whose report holds medians and peak memory but claims no ratio against a peer."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks import compare_peers
from benchmarks.peers import report as report_module
from benchmarks.compare_peers import WORKLOADS, ModelRun, kv_tokens, max_model_len, model_runs, parse_args
from benchmarks.peers.bandwidth import BANDWIDTH_TARGET, decode_bytes_per_token
from benchmarks.peers.targets import TARGETS, Target
from benchmarks.peers.pss import MIB, PssSampler, process_tree
from dabba.arch.config import ArchConfig
from dabba.models.sizes import weights_bytes
from dabba.quantization.config import QuantConfig


def test_compare_peers_runs_dabba_alone(checkpoints, tmp_path, capsys) -> None:
    out, md = tmp_path / "cmp.json", tmp_path / "cmp.md"
    path = checkpoints["llama"].path
    assert compare_peers.main(["--model", str(path), "--workloads", "W2", "--repeats", "1", "--membw-gib", "0.0625",
                               "--membw-iters", "2", "--peak-seconds", "0.05", "--json-out", str(out), "--markdown-out",
                               str(md)]) == 0
    summary = json.loads(capsys.readouterr().out)
    (model,) = summary["models"]
    w2 = model["medians"]["W2"]
    assert set(w2) == {"dabba/bf16", "dabba/int8", "dabba/int4"}
    assert all(m["decode_tok_s"] > 0 and 0 < m["ttft_s"] < m["e2e_s"] and m["peak_pss_mib"] > 0 for m in w2.values())
    assert [c["theirs"] for c in model["checks"]] == ["dabba/bf16"] * 2 + ["membw read"] * 3  # no peer, no peer ratio
    assert model["shape"]["num_layers"] == 2 and model["batch_workload"] == "W1" and model["gguf_dir"] is None
    budget = model["kv_budget"]["W2"]
    assert budget["dabba"] == kv_tokens(WORKLOADS["W2"].shape) * model["shape"]["num_layers"] * 2 * 2 * 2 * 24
    assert set(model["bandwidth"]) == {"bf16", "int8", "int4"}
    assert summary["llamacpp_extra_bufts"] is True and summary["membw"]["read_gb_s_best"] > 0
    assert model["compute"] == {}  # W2 is no throughput workload: no ceiling
    full = json.loads(out.read_text())
    assert full["models"][0]["runs"]["W2"]["dabba/int4"][0]["decode_tok_s"] == w2["dabba/int4"]["decode_tok_s"]
    text = md.read_text()
    assert f"#### {path.name}" in text and "| W2: 1 x 128 -> 256, decode tok/s | dabba | int8 |" in text


def test_unknown_workload_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        compare_peers.main(["--model", "x", "--workloads", "W9"])
    assert "unknown workloads" in capsys.readouterr().err


def test_models_are_repeatable_or_comma_lists_with_aligned_options() -> None:
    args = parse_args(["--model", "/m/a,/m/b", "--model", "/m/c", "--batch-workload", "W1,B32,B32"])
    assert args.models == [ModelRun("/m/a", "/m/a/gguf", "W1"), ModelRun("/m/b", "/m/b/gguf", "B32"),
                           ModelRun("/m/c", "/m/c/gguf", "B32")]
    args = parse_args(["--model", "/m/a", "--model", "/m/b", "--gguf-dir", "/g/a", "--gguf-dir", "/g/b",
                       "--batch-workload", "B32"])
    assert [(m.gguf_dir, m.batch_workload) for m in args.models] == [("/g/a", "B32"), ("/g/b", "B32")]
    assert args.workloads == ["BATCH", "W2", "W3", "L4"]


@pytest.mark.parametrize("argv, error", [
    (["--model", "/m/a,/m/b", "--gguf-dir", "/g/a"], "--gguf-dir: 1 directories for 2 models"),
    (["--model", "/m/a,/m/b,/m/c", "--batch-workload", "W1,B32"], "--batch-workload: 2 values for 3 models"),
    (["--model", "/m/a", "--batch-workload", "W2"], "choose from W1, B32"),
])
def test_misaligned_model_options_are_usage_errors(argv, error, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert error in capsys.readouterr().err


def test_batch_stands_for_each_models_batch_workload() -> None:
    assert ModelRun("/m", "/g", "B32").workloads(["BATCH", "W2", "L4"]) == ["B32", "W2", "L4"]
    assert ModelRun("/m", "/g").workloads(["W1", "BATCH", "W2"]) == ["W1", "W2"]
    with pytest.raises(ValueError):
        model_runs([], [], [])


def test_kv_budget_holds_every_sequence_at_full_length() -> None:
    assert WORKLOADS["L4"].shape.num_prompts == 4 and WORKLOADS["L4"].shape.input_len == 2048
    assert max_model_len(WORKLOADS["L4"].shape) == 2176 and kv_tokens(WORKLOADS["L4"].shape) == 4 * 2176 + 256
    assert max_model_len(WORKLOADS["W1"].shape) == 384 and kv_tokens(WORKLOADS["W1"].shape) == 64 * 384 + 256
    assert max_model_len(WORKLOADS["W2"].shape) == 384 and kv_tokens(WORKLOADS["W2"].shape) == 768  # 640, padded
    assert max_model_len(WORKLOADS["W3"].shape) == 640  # 512 shared + 32 + 64


def test_the_report_records_each_engines_kv_budget() -> None:
    shape = compare_peers.ModelShape("LlamaForCausalLM", 576, 30, 9, 3, 64, 1536, 49152, True, 134_515_008)
    assert shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    w = WORKLOADS["W2"]
    kv_bytes = kv_tokens(w.shape) * shape.kv_bytes_per_token
    runs = {"dabba/bf16": [{"decode_tok_s": 9.0}], "vllm/bf16": [{"decode_tok_s": 8.0, "kv_tokens": 640}],
            "llama.cpp/bf16": [{"decode_tok_s": 7.0, "n_ctx": 1024}]}
    budget = compare_peers.kv_budgets(shape, w, kv_bytes, runs)
    assert budget == {"tokens": 768, "bytes_per_token": 23040, "max_model_len": 384, "dabba": 768 * 23040,
                      "vllm": 768 * 23040, "vllm_tokens": 640, "llama.cpp": 1024 * 23040, "llama.cpp_tokens": 1024}
    assert set(compare_peers.kv_budgets(shape, w, kv_bytes, {"dabba/bf16": runs["dabba/bf16"]})) == {
        "tokens", "bytes_per_token", "max_model_len", "dabba"}


def test_specs_carry_llamacpp_kernels_and_every_engines_kv_budget(tmp_path) -> None:
    w = WORKLOADS["L4"]
    for extra_bufts in (True, False):
        path = compare_peers.write_spec(w, [[5, 6, 7]], prefix_caching=True, directory=str(tmp_path),
                                        extra_bufts=extra_bufts, kv_bytes=1000, n_ctx=40)
        spec = json.loads(open(path).read())
        assert spec["extra_bufts"] is extra_bufts
        assert (spec["kv_cache_bytes"], spec["n_ctx"], spec["max_model_len"]) == (1000, 40, 2176)


def test_targets_are_the_issues() -> None:
    got = {(t.workload, t.ours, t.theirs, t.metric): (t.op, t.bound) for t in TARGETS}
    dabba, vllm = ("dabba", "bf16"), ("vllm", "bf16")
    for w, bound in (("W1", 1.3), ("B32", 1.3), ("L4", 1.2)):
        assert got[w, dabba, vllm, "total_tok_s"] == (">=", bound)
    for v, peer, bound in (("bf16", "bf16", 1.1), ("int8", "q8_0", 1.3), ("int4", "q4_0", 1.2)):
        assert got["W2", ("dabba", v), ("llama.cpp", peer), "decode_tok_s"] == (">=", bound)
        assert got["W2", ("dabba", v), ("llama.cpp", peer), "peak_pss_mib"] == ("<=", 1.2)
    for v in ("int8", "int4"):
        assert got["W2", ("dabba", v), dabba, "peak_pss_mib"] == ("<", 1.0)
        assert got["W2", ("dabba-avx2", v), ("llama.cpp", {"int8": "q8_0", "int4": "q4_0"}[v]), "decode_tok_s"] == \
            (">=", 1.1)
    for t in ("q8_0", "q4_0", "q4_k_m"):  # dabba on llama.cpp's own file (issue 41)
        ours, theirs = ("dabba", f"gguf-{t}"), ("llama.cpp", t)
        assert got["W2", ours, theirs, "decode_tok_s"] == (">=", 1.2)
        assert got["W2", ours, theirs, "ttft_s"] == ("<=", 1.0)
        assert got["W2", ours, theirs, "peak_pss_mib"] == ("<=", 1.1)
        assert got["T512", ours, theirs, "ttft_s"] == ("<=", 1.0)  # a 512-token prompt's first token
        assert got["B32", ours, theirs, "total_tok_s"] == (">=", 2.0)
    assert BANDWIDTH_TARGET == 0.85


def test_dabba_runs_once_per_kernel_variant_with_the_cpu_that_variant_sees(monkeypatch, tmp_path) -> None:
    args = parse_args(["--model", "/m/a", "--workloads", "W2", "--variants", "bf16,int4", "--dabba-isa", "avx2,avx512",
                       "--llamacpp-python", "/p/python"])
    w2 = WORKLOADS["W2"]
    assert compare_peers.engines_for(w2, args) == [("dabba-avx2", "bf16"), ("dabba-avx2", "int4"),
                                                   ("dabba-avx512", "bf16"), ("dabba-avx512", "int4"),
                                                   ("llama.cpp", "bf16"), ("llama.cpp", "q4_0")]
    seen = []
    monkeypatch.setattr(compare_peers, "run_json", lambda cmd, env=None, **kw: seen.append((cmd, env)) or
                        {"decode_tokens_per_s": 1.0, "ttft_s": {"p50": 0.1}, "latency_s": {"p50": 1.0},
                         "peak_pss_mib": 1.0})
    job = compare_peers.Job(ModelRun("/m/a", "/g"), w2, "spec.json", 1 << 20, str(tmp_path))
    compare_peers.run_engine("dabba-avx2", "int4", job, args)
    compare_peers.run_engine("dabba", "bf16", job, args)
    assert seen[0][1] == {"DABBA_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                          "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert "--quantization" in seen[0][0] and seen[1][1] is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m/a", "--dabba-isa", "avx9"])


def test_a_gguf_variant_runs_dabba_on_the_file_llamacpp_runs(monkeypatch, tmp_path) -> None:
    args = parse_args(["--model", "/m/a", "--workloads", "W2", "--variants", "gguf-q4_k_m",
                       "--llamacpp-python", "/p/python"])
    assert compare_peers.engines_for(WORKLOADS["W2"], args) == [("dabba", "gguf-q4_k_m"), ("llama.cpp", "q4_k_m")]
    seen = []
    monkeypatch.setattr(compare_peers, "run_json", lambda cmd, env=None, **kw: seen.append(cmd) or
                        {"decode_tokens_per_s": 1.0, "ttft_s": {"p50": 0.1}, "latency_s": {"p50": 1.0},
                         "peak_pss_mib": 1.0})
    job = compare_peers.Job(ModelRun("/m/a", "/g"), WORKLOADS["W2"], "spec.json", 1 << 20, str(tmp_path))
    compare_peers.run_engine("dabba", "gguf-q4_k_m", job, args)
    assert seen[0][5] == "/g/model-q4_k_m.gguf" and "--quantization" not in seen[0]


def test_a_gguf_variants_bytes_per_token_are_the_files(tmp_path) -> None:
    """All of the file's tensors but token_embd where output.weight is the head (a step reads one row)."""
    from gguf import GGUFReader

    from benchmarks.peers.bandwidth import gguf_decode_bytes
    from tests.gguf_writer import write_llama

    for head in ("Q8_0", None):
        path = write_llama(tmp_path / f"{head}.gguf", embedding="Q4_0", head=head)
        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        assert gguf_decode_bytes(path) == sum(sizes.values()) - (sizes["token_embd.weight"] if head else 0)


def test_batch_workloads_run_the_batch_variants() -> None:
    """A mixture of experts' batches at INT4: dabba int4 against llama.cpp q4_0, vLLM in bf16."""
    args = parse_args(["--model", "/m/a", "--workloads", "B16,B64,W2", "--variants", "int4", "--batch-variants",
                       "int4", "--llamacpp-python", "/p/python", "--vllm-python", "/v/python"])
    for name in ("B16", "B64"):
        assert compare_peers.engines_for(WORKLOADS[name], args) == [("dabba", "int4"), ("vllm", "bf16"),
                                                                    ("llama.cpp", "q4_0")]
    assert WORKLOADS["B64"].shape.num_prompts == 64 and WORKLOADS["B16"].shape.num_prompts == 16
    assert compare_peers.engines_for(WORKLOADS["W1"], parse_args(["--model", "/m/a"])) == [("dabba", "bf16")]
    # T512, the first token of a 512-token prompt, runs W2's variants, each against its peer file
    t512 = parse_args(["--model", "/m/a", "--workloads", "T512", "--variants", "gguf-q4_0", "--llamacpp-python", "/p"])
    assert compare_peers.engines_for(WORKLOADS["T512"], t512) == [("dabba", "gguf-q4_0"), ("llama.cpp", "q4_0")]
    assert WORKLOADS["T512"].shape.input_len == 512 and WORKLOADS["T512"].metric == "ttft_s"
    assert report_module.figure_text("T512", {"ttft_s": 0.8123, "decode_tok_s": 30.0}) == "812 ms"
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m/a", "--batch-variants", "int3"])


def test_a_target_checks_its_ratio_in_its_direction() -> None:
    medians = {"W2": {"dabba/int8": {"decode_tok_s": 13.0, "peak_pss_mib": 500.0},
                      "llama.cpp/q8_0": {"decode_tok_s": 10.0, "peak_pss_mib": 400.0}}}
    speed = Target("W2", ("dabba", "int8"), ("llama.cpp", "q8_0"), "decode_tok_s", 1.3).check(medians)
    assert speed["ratio"] == pytest.approx(1.3) and speed["met"]
    memory = Target("W2", ("dabba", "int8"), ("llama.cpp", "q8_0"), "peak_pss_mib", 1.2, "<=").check(medians)
    assert memory["ratio"] == pytest.approx(1.25) and not memory["met"]
    assert Target("W1", ("dabba", "bf16"), ("vllm", "bf16"), "total_tok_s", 1.3).check(medians) is None


# A child that holds 64 MiB and starts a grandchild that holds 32 MiB, says "ready" once both are
# touched, and exits when its stdin closes.
TREE = textwrap.dedent("""
    import subprocess, sys
    held = bytes([1]) * (64 * 2**20)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import sys; held = bytes([1]) * (32 * 2**20); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild.stdout.readline()
    print(grandchild.pid, flush=True)
    sys.stdin.read()
    grandchild.stdin.close()
    grandchild.wait()
""")


def test_the_pss_sampler_sums_the_whole_process_tree() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with PssSampler(proc.pid, interval=3600) as pss:  # one sample at the start, then ours
            grandchild = int(proc.stdout.readline())
            assert set(process_tree(proc.pid)) >= {proc.pid, grandchild}
            pss.sample()
    finally:
        proc.stdin.close()
        proc.wait()
    assert pss.samples == 2
    assert 96 * MIB <= pss.peak < 96 * MIB + 200 * MIB  # both buffers, plus two interpreters at most
    assert pss.peak_mib == pss.peak / MIB


def test_decode_bytes_are_the_weights_a_step_reads(checkpoints) -> None:
    from benchmarks.membw import weight_bytes

    tied = str(checkpoints["qwen2"].path)  # float32 on disk, read as bf16
    bf16 = decode_bytes_per_token(tied, "bf16")
    assert 2 * bf16 == weight_bytes(tied)  # the tied embedding counted once: the LM head reads it
    int8, int4 = (decode_bytes_per_token(tied, v) for v in ("int8", "int4"))
    assert int4 < int8 < bf16
    # quantized, the table is the head's INT8 codes, which the embedding shares: counted once too
    arch = ArchConfig.from_hf(tied)
    assert int8 == weights_bytes(arch, torch.bfloat16, QuantConfig("int8"))


def report(checks: list[dict]) -> dict:
    medians = {"W2": {"dabba/bf16": {"decode_tok_s": 50.0, "ttft_s": 0.05, "e2e_s": 5.0, "peak_pss_mib": 700.0},
                      "llama.cpp/bf16": {"decode_tok_s": 40.0, "ttft_s": 0.04, "e2e_s": 6.0, "peak_pss_mib": 650.0}},
               "L4": {"dabba/bf16": {"total_tok_s": 900.0, "peak_pss_mib": 800.0}}}
    model = {"name": "smollm2-135m", "description": "LlamaForCausalLM, hidden 576", "medians": medians,
             "kv_budget": {"W2": {"dabba": 640 * 23040, "llama.cpp": 768 * 23040}, "L4": {"dabba": 9 * MIB}},
             "bandwidth": {"bf16": {"bytes_per_token": 256 * MIB, "decode_tok_s": 50.0, "decode_gb_s": 13.4,
                                    "share_of_read_bw": 0.9}}, "checks": checks}
    return {"cpu": "Test CPU, 2 cores", "date": "2025-01-01 00:00 UTC", "repeats": 3, "llamacpp_extra_bufts": False,
            "membw": {"threads": 2, "buffer_gib": 2.0, "read_gb_s_best": 14.9, "read_gb_s_median": 14.5},
            "models": [model]}


def test_markdown_has_a_table_per_shape_with_the_cpu_and_targets() -> None:
    checks = [Target("W2", ("dabba", "bf16"), ("llama.cpp", "bf16"), "decode_tok_s", 1.1).check(
                  report([])["models"][0]["medians"]),
              Target("W2", ("dabba", "bf16"), ("llama.cpp", "bf16"), "peak_pss_mib", 1.2, "<=").check(
                  report([])["models"][0]["medians"])]
    text = report_module.to_markdown(report(checks))
    assert text.startswith("CPU: Test CPU, 2 cores. Date: 2025-01-01 00:00 UTC.")
    assert "14.9 GB/s best" in text and "lower bounds" in text
    assert "#### smollm2-135m" in text and "LlamaForCausalLM, hidden 576." in text
    assert "| W2: 1 x 128 -> 256, decode tok/s | dabba | bf16 | 50.0 (TTFT 50 ms) | 700 | 14 |" in text
    assert "| W2: 1 x 128 -> 256, decode tok/s | llama.cpp | bf16 | 40.0 (TTFT 40 ms) | 650 | 17 |" in text
    assert "| L4: 4 x 2048 -> 64, total tok/s | dabba | bf16 | 900.0 | 800 | 9 |" in text
    assert "= 13.4 GB/s, 90% of the read bandwidth" in text
    assert "| W2 decode tok/s | dabba/bf16 | llama.cpp/bf16 | 1.25 | >= 1.1 | yes |" in text
    assert "| W2 peak PSS | dabba/bf16 | llama.cpp/bf16 | 1.08 | <= 1.2 | yes |" in text


def test_cpu_name_comes_from_cpuinfo() -> None:
    assert "cores" in compare_peers.cpu_name()
