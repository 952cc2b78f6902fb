"""benchmarks/compare_peers.py without peers installed: dabba's side of W2 runs through
`dabba bench latency` in fresh processes, and the report holds medians but claims no ratios."""
from __future__ import annotations

import json

from benchmarks import compare_peers


def test_compare_peers_runs_dabba_alone(checkpoints, tmp_path, capsys) -> None:
    out = tmp_path / "cmp.json"
    assert compare_peers.main(["--model", str(checkpoints["llama"].path), "--workloads", "W2", "--repeats", "1",
                               "--json-out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    w2 = summary["medians"]["W2"]
    assert set(w2) == {"dabba/bf16", "dabba/int8", "dabba/int4"}
    assert all(m["decode_tok_s"] > 0 and 0 < m["ttft_s"] < m["e2e_s"] for m in w2.values())
    assert summary["ratios"] == []  # no peer, no ratio
    assert summary["llamacpp_extra_bufts"] is True
    assert json.loads(out.read_text())["runs"]["W2"]["dabba/int4"][0]["decode_tok_s"] == w2["dabba/int4"]["decode_tok_s"]


def test_unknown_workload_is_a_usage_error(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        compare_peers.main(["--model", "x", "--workloads", "W9"])
    assert "unknown workloads" in capsys.readouterr().err


def test_specs_say_whether_llamacpp_may_use_its_repacked_kernels(tmp_path) -> None:
    w = compare_peers.WORKLOADS["W2"]
    for extra_bufts in (True, False):
        path = compare_peers.write_spec(w, [[5, 6, 7]], prefix_caching=True, directory=str(tmp_path),
                                        extra_bufts=extra_bufts)
        assert json.loads(open(path).read())["extra_bufts"] is extra_bufts
