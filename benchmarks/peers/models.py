"""The models compare_peers runs (--model, --gguf-dir, --batch-workload zipped), what its report
says of each checkpoint, and the KV budget every engine gets on a workload."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers.workloads import BATCH_WORKLOADS, Workload
from dabba.arch.config import ArchConfig
from dabba.tools.bench.offline import OfflineWorkload

KV_ROUND = 128  # tokens: a sequence's KV share, a multiple of every engine's block size
KV_SLACK = 256  # tokens on top: what an engine reserves (vLLM's null block) must not cost a sequence
BATCH = "BATCH"  # in --workloads: each model's --batch-workload


# --- models -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelRun:
    """One --model: its checkpoint, its GGUF directory, its batch workload."""
    path: str
    gguf_dir: str
    batch_workload: str = "W1"

    def workloads(self, names: list[str]) -> list[str]:
        """``names`` with BATCH replaced by this model's batch workload, each once."""
        out = [self.batch_workload if n == BATCH else n for n in names]
        return list(dict.fromkeys(out))


@dataclass(frozen=True)
class ModelShape:
    """What the report says of a checkpoint, and what its KV cache costs per token."""
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    params: int

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelShape:
        a = ArchConfig.from_hf(model_dir)
        return cls(a.architecture, a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads,
                   a.head_dim, a.intermediate_size, a.vocab_size, a.tie_word_embeddings, param_count(model_dir))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer at 2 bytes (bf16 in dabba and vLLM, f16 in llama.cpp)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def describe(self) -> str:
        return (f"{self.architecture}, hidden {self.hidden_size}, {self.num_layers} layers, "
                f"{self.num_heads}/{self.num_kv_heads} heads (head_dim {self.head_dim}), intermediate "
                f"{self.intermediate_size}, vocab {self.vocab_size}, {self.params / 1e6:.0f}M params"
                f"{', tied embeddings' if self.tied_embeddings else ''}")


def param_count(model_dir: str) -> int:
    """Elements of the checkpoint's tensors (safetensors headers only)."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def split_list(values: list[str] | None) -> list[str]:
    """A repeatable option whose values may also be comma lists, flattened."""
    return [v.strip() for value in values or [] for v in value.split(",") if v.strip()]


def aligned(name: str, values: list[str], n: int, default: list[str]) -> list[str]:
    """``values`` for ``n`` models: none (``default``), one for all, or one each."""
    if not values:
        return default
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{name}: {len(values)} values for {n} models (give one, or one per --model)")
    return values


def model_runs(models: list[str], gguf_dirs: list[str], batch_workloads: list[str]) -> list[ModelRun]:
    """--model, --gguf-dir and --batch-workload zipped; GGUF files default to DIR/gguf/."""
    if not models:
        raise ValueError("--model: at least one checkpoint directory")
    if gguf_dirs and len(gguf_dirs) != len(models):
        raise ValueError(f"--gguf-dir: {len(gguf_dirs)} directories for {len(models)} models (one per --model)")
    ggufs = gguf_dirs or [str(Path(m) / "gguf") for m in models]
    batches = aligned("--batch-workload", batch_workloads, len(models), ["W1"] * len(models))
    bad = [b for b in batches if b not in BATCH_WORKLOADS]
    if bad:
        raise ValueError(f"--batch-workload: {bad}; choose from {', '.join(BATCH_WORKLOADS)}")
    return [ModelRun(m, g, b) for m, g, b in zip(models, ggufs, batches)]


# --- KV budget ----------------------------------------------------------------------------------

def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def max_model_len(shape: OfflineWorkload) -> int:
    """The longest sequence of the workload, rounded up to KV_ROUND tokens."""
    return round_up(shape.prefix_len + shape.input_len + shape.output_len, KV_ROUND)


def kv_tokens(shape: OfflineWorkload) -> int:
    """The KV budget in tokens: every sequence at once, at its full length, plus KV_SLACK, rounded
    up to llama.cpp's context padding (256) so that its n_ctx is the others' budget exactly."""
    return round_up(shape.num_prompts * max_model_len(shape) + KV_SLACK, 256)


def kv_budgets(shape: ModelShape, w: Workload, kv_bytes: int,
               runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each engine's KV budget on one workload in bytes, and in tokens where the peer says what it
    made of it (vLLM's blocks, llama.cpp's n_ctx, whose bytes follow from it)."""
    out: dict[str, Any] = {"tokens": kv_tokens(w.shape), "bytes_per_token": shape.kv_bytes_per_token,
                           "max_model_len": max_model_len(w.shape), "dabba": kv_bytes}

    def reported(engine: str, key: str) -> int | None:
        return next((r[key] for k, rs in runs.items() if k.startswith(f"{engine}/") for r in rs if key in r), None)

    if any(k.startswith("vllm/") for k in runs):
        out["vllm"] = kv_bytes
        out["vllm_tokens"] = reported("vllm", "kv_tokens")
    if (n_ctx := reported("llama.cpp", "n_ctx")) is not None:
        out["llama.cpp"] = n_ctx * shape.kv_bytes_per_token
        out["llama.cpp_tokens"] = n_ctx
    return out
