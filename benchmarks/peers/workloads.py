"""The workloads compare_peers runs on every engine: shapes and the figure each is compared by."""
from __future__ import annotations

from dataclasses import dataclass

from dabba.tools.bench.offline import OfflineWorkload

@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "throughput" | "latency"
    shape: OfflineWorkload
    metric: str  # the figure the speed ratios compare


WORKLOADS = {
    "W1": Workload("W1", "throughput", OfflineWorkload(64, 256, 128), "total_tok_s"),
    "B32": Workload("B32", "throughput", OfflineWorkload(32, 256, 64), "total_tok_s"),
    "W2": Workload("W2", "latency", OfflineWorkload(1, 128, 256), "decode_tok_s"),
    # the GGUF issue's time to first token: one 512-token prompt, a few tokens out
    "T512": Workload("T512", "latency", OfflineWorkload(1, 512, 16), "ttft_s"),
    "W3": Workload("W3", "throughput", OfflineWorkload(32, 32, 64, prefix_len=512), "total_tok_s"),
    "L4": Workload("L4", "throughput", OfflineWorkload(4, 2048, 64), "total_tok_s"),
    # a mixture of experts' batches, where the union of the experts a step reads grows with them
    "B16": Workload("B16", "throughput", OfflineWorkload(16, 256, 64), "total_tok_s"),
    "B64": Workload("B64", "throughput", OfflineWorkload(64, 256, 64), "total_tok_s"),
}
BATCH_WORKLOADS = ("W1", "B32")
# the workloads that run --variants (each weight format against its peer); the others --batch-variants
LATENCY_WORKLOADS = ("W2", "T512")
