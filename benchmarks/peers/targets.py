"""The targets compare_peers holds dabba to, per workload: ratios of one engine's median to
another's, and what a dabba process is shown of the CPU when it runs as one kernel variant."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Target:
    """ours / theirs of one metric on one workload, held to ``bound`` by ``op``."""
    workload: str
    ours: tuple[str, str]  # (engine, variant)
    theirs: tuple[str, str]
    metric: str
    bound: float
    op: str = ">="

    def check(self, medians: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any] | None:
        got = medians.get(self.workload, {})
        a, b = got.get("/".join(self.ours), {}).get(self.metric), got.get("/".join(self.theirs), {}).get(self.metric)
        if not a or not b:
            return None
        ratio = a / b
        return {"workload": self.workload, "ours": "/".join(self.ours), "theirs": "/".join(self.theirs),
                "metric": self.metric, "value": a, "peer_value": b, "ratio": ratio, "target": self.bound,
                "op": self.op, "met": OPS[self.op](ratio, self.bound)}


DABBA, VLLM = ("dabba", "bf16"), ("vllm", "bf16")
# what a process sees of the CPU when compare_peers runs dabba as one kernel variant
ISA_ENV = {"avx2": {"DABBA_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"DABBA_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL"},
           "generic": {"DABBA_CPU_ISA": "generic", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}}
# llama.cpp's counterpart of each dabba variant (w8a8: the nearest, 8-bit weights; llama.cpp rounds
# activations to 8 bits in its Q8_0 dot products too)
PEER_VARIANT = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "w8a8": "q8_0"}
GGUF_TYPES = ("q8_0", "q4_0", "q4_k_m")  # dabba variant gguf-<type>: dabba serves llama.cpp's own file
PEER_VARIANT.update({f"gguf-{t}": t for t in GGUF_TYPES})
SPEEDUP_W2 = {"bf16": 1.1, "int8": 1.3, "int4": 1.2}
TARGETS = [
    Target("W1", DABBA, VLLM, "total_tok_s", 1.3),
    Target("B32", DABBA, VLLM, "total_tok_s", 1.3),  # W1's target on the larger shapes
    Target("L4", DABBA, VLLM, "total_tok_s", 1.2),
    Target("W3", DABBA, VLLM, "total_tok_s", 1.0),
    *(Target("W2", ("dabba", v), ("llama.cpp", PEER_VARIANT[v]), "decode_tok_s", x) for v, x in SPEEDUP_W2.items()),
    Target("W2", DABBA, VLLM, "ttft_s", 1.0, "<="),
    *(Target("W2", ("dabba", v), ("llama.cpp", PEER_VARIANT[v]), "peak_pss_mib", 1.2, "<=") for v in SPEEDUP_W2),
    # load-time quantization must not cost more memory than the bf16 weights it replaces
    *(Target("W2", ("dabba", v), DABBA, "peak_pss_mib", 1.0, "<") for v in ("int8", "int4")),
    # the same GGUF file: decode 1.2x llama.cpp's, TTFT (of 128 and of 512 prompt tokens) no more, peak PSS at
    # most 1.1x (issue 41)
    *(Target("W2", ("dabba", f"gguf-{t}"), ("llama.cpp", t), "decode_tok_s", 1.2) for t in GGUF_TYPES),
    *(Target("W2", ("dabba", f"gguf-{t}"), ("llama.cpp", t), "ttft_s", 1.0, "<=") for t in GGUF_TYPES),
    *(Target("W2", ("dabba", f"gguf-{t}"), ("llama.cpp", t), "peak_pss_mib", 1.1, "<=") for t in GGUF_TYPES),
    *(Target("T512", ("dabba", f"gguf-{t}"), ("llama.cpp", t), "ttft_s", 1.0, "<=") for t in GGUF_TYPES),
    # and 32 requests x 256 -> 64 at least 2x llama.cpp's batched API on it
    *(Target("B32", ("dabba", f"gguf-{t}"), ("llama.cpp", t), "total_tok_s", 2.0) for t in GGUF_TYPES),
    # W8A8 (issue 42): batches past the bf16 ceiling; vLLM on the same weights as a compressed-tensors
    # W8A8 checkpoint (written by dabba quantize --method w8a8) as ("vllm", "w8a8")
    Target("B32", ("dabba", "w8a8"), VLLM, "total_tok_s", 1.6),
    Target("B32", ("dabba", "w8a8"), ("vllm", "w8a8"), "total_tok_s", 1.15),
    # --dabba-isa with an AVX2-only llama.cpp: the AVX2 variant keeps its lead at batch-1 decode
    *(Target("W2", ("dabba-avx2", v), ("llama.cpp", PEER_VARIANT[v]), "decode_tok_s", 1.1) for v in SPEEDUP_W2),
]
