"""compare_peers' report: the per-shape markdown tables for the README, the JSON summary and the
targets printed to stderr."""
from __future__ import annotations

import sys
from typing import Any

from benchmarks.peers.compute import compute_lines
from benchmarks.peers.workloads import WORKLOADS

MIB = 2**20


METRIC_LABELS = {"total_tok_s": "total tok/s", "decode_tok_s": "decode tok/s", "ttft_s": "TTFT",
                 "peak_pss_mib": "peak PSS", "decode_gb_s": "decode GB/s"}


def figure_text(w: str, m: dict[str, float]) -> str:
    metric = WORKLOADS[w].metric
    if metric == "ttft_s":
        return f"{m[metric] * 1000:.0f} ms" if metric in m else "-"
    text = f"{m[metric]:.1f}" if metric in m else "-"
    return text + (f" (TTFT {m['ttft_s'] * 1000:.0f} ms)" if "ttft_s" in m else "")


def workload_text(w: str) -> str:
    """"W2: 1 x 128 -> 256, decode tok/s"."""
    s = WORKLOADS[w].shape
    prompt = f"({s.prefix_len} shared + {s.input_len})" if s.prefix_len else str(s.input_len)
    return f"{w}: {s.num_prompts} x {prompt} -> {s.output_len}, {METRIC_LABELS[WORKLOADS[w].metric]}"


def check_text(c: dict[str, Any]) -> str:
    label = METRIC_LABELS.get(c["metric"], c["metric"])
    return (f"| {c['workload']} {label} | {c['ours']} | {c['theirs']} | {c['ratio']:.2f} | {c['op']} {c['target']} "
            f"| {'yes' if c['met'] else '**no**'} |")


def model_markdown(r: dict[str, Any], peak: dict[str, Any] | None) -> list[str]:
    """One shape: its figures, then its targets."""
    lines = [f"#### {r['name']}", "", r["description"] + ".", "",
             "| workload | engine | weights | figure | peak PSS (MiB) | KV budget (MiB) |", "|---|---|---|---|---|---|"]
    for w, per_engine in r["medians"].items():
        for key, m in per_engine.items():
            engine, variant = key.split("/")
            kv = r["kv_budget"][w].get(engine)
            lines.append(f"| {workload_text(w)} | {engine} | {variant} | {figure_text(w, m)} | "
                         f"{m.get('peak_pss_mib', 0):.0f} | {f'{kv / MIB:.0f}' if kv else '-'} |")
    if r["bandwidth"]:
        lines.append("")
    for variant, b in r["bandwidth"].items():
        share = f", {b['share_of_read_bw']:.0%} of the read bandwidth" if "share_of_read_bw" in b else ""
        lines.append(f"W2 decode, dabba {variant}: {b['bytes_per_token'] / MIB:.0f} MiB of weights per token x "
                     f"{b['decode_tok_s']:.1f} tok/s = {b['decode_gb_s']:.1f} GB/s{share}.  ")
    ceilings = compute_lines(r["name"], r.get("compute", {}), peak)
    if ceilings:
        lines += [""] + [f"{line}.  " for line in ceilings]
    if r["checks"]:
        lines += ["", "| target | dabba | against | ratio | target | met |", "|---|---|---|---|---|---|"]
        lines += [check_text(c) for c in r["checks"]]
    return lines + [""]


def to_markdown(result: dict[str, Any]) -> str:
    """The per-shape tables, ready to paste into the README."""
    membw = result.get("membw")
    runs = f"{result['repeats']} fresh-process run{'s' if result['repeats'] != 1 else ''}"
    head = [f"CPU: {result['cpu']}. Date: {result['date']}. Medians of {runs} per engine; peak PSS of each "
            "benchmark's process tree; every engine at the same KV budget per workload."]
    if membw:
        head.append(f"Memory read bandwidth (benchmarks/membw.py, {membw['threads']} threads, "
                    f"{membw['buffer_gib']:g} GiB): {membw['read_gb_s_best']:.1f} GB/s best, "
                    f"{membw['read_gb_s_median']:.1f} GB/s median.")
    if not result["llamacpp_extra_bufts"]:
        head.append("llama.cpp ran without its repacked weight kernels (they crash here): "
                    "its figures are lower bounds.")
    lines = [" ".join(head), ""]
    for r in result["models"]:
        lines += model_markdown(r, result.get("compute_peak"))
    return "\n".join(lines)


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """The result without the per-repeat runs."""
    out = {k: v for k, v in result.items() if k != "models"}
    out["models"] = [{k: v for k, v in r.items() if k != "runs"} for r in result["models"]]
    if "serve" in result:
        out["serve"] = {k: v for k, v in result["serve"].items() if k != "runs"}
    return out


def print_checks(result: dict[str, Any]) -> None:
    for r in result["models"]:
        for line in compute_lines(r["name"], r.get("compute", {}), result.get("compute_peak")):
            print(line, file=sys.stderr)
        for c in r["checks"]:
            print(f"{r['name']} {c['workload']}: {c['ours']} / {c['theirs']} {c['metric']}: {c['ratio']:.2f} "
                  f"(target {c['op']} {c['target']}: {'met' if c['met'] else 'NOT met'})", file=sys.stderr)
    for c in result.get("serve", {}).get("checks", []):
        print(f"serve {c['metric']}: dabba {c['dabba']:.1f}, vllm {c['vllm']:.1f} ({'met' if c['met'] else 'NOT met'})",
              file=sys.stderr)
