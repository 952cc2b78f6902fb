"""`dabba bench throughput|latency|embed|serve`: the workload, the CLI and the JSON it prints (never timings)."""
from __future__ import annotations

import json

import pytest

from dabba.config import DEMO_MODEL
from dabba.engine.tokenizer import Tokenizer
from dabba.entrypoints.cli import main
from dabba.tools.bench.offline import OfflineWorkload, make_prompts


def test_random_prompts_are_seeded_and_exact() -> None:
    w = OfflineWorkload(num_prompts=5, input_len=33, seed=7)
    a, b = make_prompts(w, 100), make_prompts(w, 100)
    assert a == b and len(a) == 5 and all(len(p) == 33 and min(p) >= 3 and max(p) < 100 for p in a)
    assert make_prompts(OfflineWorkload(num_prompts=5, input_len=33, seed=8), 100) != a


def test_random_prompts_with_a_shared_prefix() -> None:
    prompts = make_prompts(OfflineWorkload(num_prompts=4, input_len=10, prefix_len=20, seed=3), 1000)
    assert all(len(p) == 30 and p[:20] == prompts[0][:20] for p in prompts)
    assert len({tuple(p[20:]) for p in prompts}) == 4  # each prompt's own part differs
    with pytest.raises(ValueError, match="prefix_len"):
        make_prompts(OfflineWorkload(dataset="file", dataset_path="x", prefix_len=4), 0)


def test_file_prompts_are_windows_of_the_text(tmp_path) -> None:
    tok = Tokenizer(DEMO_MODEL)
    path = tmp_path / "t.txt"
    path.write_text(open(f"{DEMO_MODEL}/heldout.txt").read()[:5000])
    ids = tok.encode(path.read_text(), add_special_tokens=False)
    prompts = make_prompts(OfflineWorkload(num_prompts=3, input_len=50, dataset="file", dataset_path=str(path)), 0, tok)
    assert prompts == [ids[0:50], ids[50:100], ids[100:150]]
    with pytest.raises(ValueError, match="dataset"):
        make_prompts(OfflineWorkload(dataset="file"), 0, tok)


def test_bench_throughput_cli(checkpoints, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", str(checkpoints["llama"].path), "--num-prompts", "6", "--input-len", "20",
                 "--output-len", "7", "--dtype", "float32", "--json-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    assert result["num_output_tokens"] == 42 and result["engine"] == {"dtype": "float32"}
    assert result["total_tokens_per_s"] > result["output_tokens_per_s"] > 0


def test_bench_throughput_cli_with_a_shared_prefix(checkpoints, capsys) -> None:
    assert main(["bench", "throughput", str(checkpoints["llama"].path), "--num-prompts", "4", "--prefix-len", "40",
                 "--input-len", "8", "--output-len", "3", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["prefix_len"] == 40 and result["num_output_tokens"] == 12
    # 4 prompts of 48 tokens and 12 outputs: the total rate counts every prompt's full length
    assert result["total_tokens_per_s"] == pytest.approx((4 * 48 + 12) / result["elapsed_s"])


def test_bench_latency_cli(checkpoints, capsys) -> None:
    assert main(["bench", "latency", str(checkpoints["llama"].path), "--batch-size", "2", "--input-len", "16",
                 "--output-len", "5", "--num-iters-warmup", "1", "--num-iters", "3", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("latency_s", "ttft_s"):
        s = result[key]
        assert 0 < s["p10"] <= s["p50"] <= s["p90"] <= s["p99"]
    assert result["workload"]["batch_size"] == 2
    assert result["prefix_cache_hit_tokens"] == 0  # each timed iteration prefills its prompt in full


def test_bench_embed_cli(tmp_path, capsys) -> None:
    from tools.embedding_checkpoints import encoder_checkpoint

    path = encoder_checkpoint(tmp_path / "bert", "BertModel", "CLS")
    assert main(["bench", "embed", str(path), "--num-prompts", "10", "--input-len", "20", "--batch-size", "4",
                 "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["num_prompts"], result["batch_size"], result["dimensions"]) == (10, 4, 64)
    assert result["tokens_per_s"] == pytest.approx(result["documents_per_s"] * result["mean_input_tokens"])
    assert result["mean_input_tokens"] > 2  # the texts' tokens and the encoder's two specials


def test_bench_serve_cli_reports_failures_without_a_server(tmp_path, capsys) -> None:
    """The wiring of `dabba bench serve` (the client itself is tested against the real server in
    tests/entrypoints/test_bench_serve.py): nothing listens on the port, every request fails."""
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "3",
                 "--input-len", "4", "--output-len", "2", "--json-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 0 and result["failed"] == 3 and result["errors"]
    assert json.loads(out.read_text())["failed"] == 3
