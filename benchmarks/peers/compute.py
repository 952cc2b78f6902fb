"""How far the batch workloads' figures are from what the machine's arithmetic allows
(benchmarks/compute_peak.py): compare_peers' compute report."""
from __future__ import annotations

from typing import Any

from benchmarks.compute_peak import ceiling
from benchmarks.peers.workloads import WORKLOADS
from dabba.arch.config import ArchConfig


def compute_report(model_dir: str, medians: dict[str, dict[str, dict[str, float]]],
                   peak: dict[str, Any] | None) -> dict[str, Any]:
    """Per throughput workload: its flops, the least time and best total tokens/s at the peak, and
    each engine's share of that best (so a ratio target's ceiling: the best over the peer's figure)."""
    if not peak:
        return {}
    arch = ArchConfig.from_hf(model_dir)
    report = {}
    for name, per_engine in medians.items():
        w = WORKLOADS[name]
        if w.kind != "throughput":
            continue
        entry = ceiling(arch, w.shape, peak)
        best = entry.get("total_tok_s_at_peak")
        if best:
            entry["share_of_peak"] = {key: m[w.metric] / best for key, m in per_engine.items() if w.metric in m}
        report[name] = entry
    return report


def compute_lines(name: str, report: dict[str, Any], peak: dict[str, Any] | None) -> list[str]:
    """One line per workload: the ceiling and each engine's share of it."""
    if not peak or not peak.get("peak_gflops"):
        return []
    if peak.get("amx"):
        return [f"{name}: no compute ceiling (AMX tiles outrun the {peak['instruction']} probe)"]
    lines = []
    for w, entry in report.items():
        shares = ", ".join(f"{key} {share:.0%}" for key, share in entry.get("share_of_peak", {}).items())
        lines.append(f"{name} {w}: {entry['flops']['total'] / 1e12:.1f} TFLOP take at least "
                     f"{entry['seconds_at_peak']:.1f} s at {peak['peak_gflops']:.0f} GFLOP/s ({peak['instruction']}): "
                     f"{entry['total_tok_s_at_peak']:.1f} total tok/s at most; reached: {shares}")
    return lines
