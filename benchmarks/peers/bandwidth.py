"""How fast dabba's batch-1 decode reads its weights, against the machine's read bandwidth
(benchmarks/membw.py): compare_peers' bandwidth report and its check."""
from __future__ import annotations

import statistics
from typing import Any

from dabba.arch.config import ArchConfig

BANDWIDTH_TARGET = 0.85  # W2 decode GB/s over the read bandwidth membw measures
DABBA_QUANT = {"bf16": None, "int8": "int8", "int4": "int4", "w8a8": "w8a8"}  # dabba's load-time quantization per variant


def gguf_file(gguf_dir: str, variant: str) -> str | None:
    """The file a gguf-<type> variant serves (make_gguf.py's name); None for the other variants."""
    from pathlib import Path

    return str(Path(gguf_dir) / f"model-{variant.removeprefix('gguf-')}.gguf") if variant.startswith("gguf-") else None


def copy_bandwidth(gib: float, iters: int) -> dict[str, Any]:
    """benchmarks/membw.py's read bandwidth of this machine, best and median GB/s."""
    import torch

    from benchmarks.membw import read_bandwidth

    rates = read_bandwidth(int(gib * 2**30), iters)
    return {"threads": torch.get_num_threads(), "buffer_gib": gib, "read_gb_s_best": max(rates),
            "read_gb_s_median": statistics.median(rates)}


def gguf_decode_bytes(path: str) -> int:
    """A GGUF file's tensors' bytes less token_embd's where output.weight is the head (a step reads
    one row of the table): dabba holds the file's blocks as they are."""
    from dabba.arch.gguf_file import read_gguf

    f = read_gguf(path)
    total = sum(t.data.nbytes for t in f.tensors.values())
    return total - f.tensors["token_embd.weight"].data.nbytes if "output.weight" in f.tensors else total


def decode_bytes_per_token(model_dir: str, variant: str) -> int:
    """Weight bytes one batch-1 decode step reads, at dabba's own packed sizes: every weight but
    the embedding table (a step reads one row of it), except a bf16 tied embedding, which the LM
    head reads whole (load-time quantized, the embedding reads its rows from the head's INT8 codes,
    so a tied model's table is counted once either way); of a mixture of experts, the top_k
    experts a token takes in each routed layer."""
    import torch

    from dabba.models.sizes import weights_bytes
    from dabba.quantization.config import QuantConfig

    arch = ArchConfig.from_hf(model_dir)
    quant = DABBA_QUANT[variant]
    total = weights_bytes(arch, torch.bfloat16, QuantConfig(quant) if quant else None, active=True)
    if arch.tie_word_embeddings:
        return total
    return total - arch.vocab_size * arch.hidden_size * torch.bfloat16.itemsize


def bandwidth_report(model_dir: str, w2: dict[str, dict[str, float]], membw: dict[str, Any] | None,
                     gguf_dir: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """dabba's W2 decode GB/s per variant, its share of membw's best read, and the checks."""
    report, checks = {}, []
    for key, m in w2.items():
        engine, variant = key.split("/")
        if engine != "dabba" or not m.get("decode_tok_s"):
            continue
        path = gguf_file(gguf_dir, variant) if gguf_dir else None
        nbytes = gguf_decode_bytes(path) if path else decode_bytes_per_token(model_dir, variant)
        gb_s = nbytes * m["decode_tok_s"] / 1e9
        report[variant] = {"bytes_per_token": nbytes, "decode_tok_s": m["decode_tok_s"], "decode_gb_s": gb_s}
        if membw:
            share = gb_s / membw["read_gb_s_best"]
            report[variant]["share_of_read_bw"] = share
            checks.append({"workload": "W2", "ours": key, "theirs": "membw read", "metric": "decode_gb_s",
                           "value": gb_s, "peer_value": membw["read_gb_s_best"], "ratio": share,
                           "target": BANDWIDTH_TARGET, "op": ">=", "met": share >= BANDWIDTH_TARGET})
    return report, checks
