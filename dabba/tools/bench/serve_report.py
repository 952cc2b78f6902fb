"""What `dabba bench serve` shows of a result: a text table like `vllm bench serve`'s, a PNG chart,
and the JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any



def format_serve_result(result: dict[str, Any]) -> str:
    """A short human-readable table, like `vllm bench serve`'s."""
    lines = [
        f"{'Successful requests:':<34}{result['completed']:>12}",
        f"{'Failed requests:':<34}{result['failed']:>12}",
        f"{'Benchmark duration (s):':<34}{result['duration_s']:>12.2f}",
        f"{'Total input tokens:':<34}{result['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<34}{result['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<34}{result['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<34}{result['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<34}{result['total_token_throughput']:>12.2f}",
    ]
    if "goodput" in result:
        lines.append(f"{'Request goodput (req/s):':<34}{result['goodput']:>12.2f}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = result[key]
        if s["mean"] is None:
            continue
        lines.append(f"{name + ' (ms) mean/p50/p90/p99:':<34}"
                     f"{s['mean']:>9.2f}{s['p50']:>9.2f}{s['p90']:>9.2f}{s['p99']:>9.2f}")
    for msg, n in list(result.get("errors", {}).items())[:5]:
        lines.append(f"error x{n}: {msg[:200]}")
    return "\n".join(lines)


def plot_serve(result: dict[str, Any], path: str | Path) -> None:
    """PNG: mean/p50/p90/p99 of TTFT, TPOT, ITL and E2E; with per-request records (save_requests)
    also a timeline of every request (arrival, first token, end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = result.get("requests")
    ncols = 2 if reqs else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
    ax = axes[0][0]
    metrics = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")]
    stats = ("mean", "p50", "p90", "p99")
    width = 0.2
    for j, stat in enumerate(stats):
        vals = [result[k][stat] or 0.0 for k, _ in metrics]
        ax.bar([i + (j - 1.5) * width for i in range(len(metrics))], vals, width, label=stat)
    ax.set_xticks(range(len(metrics)), [n for _, n in metrics])
    ax.set_yscale("symlog")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['completed']} ok / {result['failed']} failed, "
                 f"{result['output_throughput']:.1f} tok/s out")
    if reqs:
        ax = axes[0][1]
        for r in reqs:
            i = r["index"]
            ax.plot([r["arrival_s"], r["send_s"]], [i, i], color="0.7", lw=1)
            if r["success"] and r["first_token_s"] is not None:
                ax.plot([r["send_s"], r["first_token_s"]], [i, i], color="tab:orange", lw=2)
                ax.plot([r["first_token_s"], r["end_s"]], [i, i], color="tab:blue", lw=2)
            else:
                ax.plot([r["send_s"], r["end_s"]], [i, i], color="tab:red", lw=2)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("request")
        ax.set_title("queued (grey), to first token (orange), decoding (blue)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_serve_outputs(result: dict[str, Any], json_out: str | None = None, chart: str | None = None) -> None:
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if chart:
        plot_serve(result, chart)
