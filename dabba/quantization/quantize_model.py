"""`dabba quantize`: GPTQ (or round-to-nearest) over a whole checkpoint, one decoder layer at a
time, saved in AutoGPTQ's layout (symmetric codes, checkpoint_format "gptq").

Layer by layer: the calibration hidden states go through layer L with its full-precision
weights while hooks accumulate each linear's Hessian; the layer is quantized; then the same
inputs go through the quantized layer to give layer L+1 its inputs. So each layer is calibrated
on what the quantized model below it really produces, and only one layer's Hessians are held.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dabba.attention.backend import AttentionBackend, forward_context
from dabba.engine.tokenizer import Tokenizer
from dabba.layers.linear import Linear
from dabba.models.config import ArchConfig
from dabba.models.loader import find_weight_files, load_model
from dabba.quantization.formats import gptq_pack
from dabba.quantization.gptq import HessianAccumulator, gptq_quantize

# checkpoint names of the shards of each merged layer, in their order
SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class DenseCausalBackend(AttentionBackend):
    """Attention for calibration: equal-length sequences, causal, no KV cache."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def kv_cache_shape(self, *args) -> tuple[int, ...]:
        return ()

    def build_metadata(self, common):
        return None

    def forward(self, q, k, v, kv_cache, metadata, scale):
        n = q.shape[0] // self.seq_len
        def split(t):  # [tokens, heads, d] -> [seqs, heads, L, d]
            return t.view(n, self.seq_len, *t.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "gptq"  # or "rtn"
    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    num_samples: int = 64  # calibration windows
    seq_len: int = 256
    damp: float = 0.01


def calibration_windows(tokenizer: Tokenizer, text: str, num: int, seq_len: int) -> torch.Tensor:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one window of {seq_len}")
    starts = torch.linspace(0, len(ids) - seq_len, steps=min(num, len(ids) // seq_len)).long()
    return torch.stack([torch.tensor(ids[s:s + seq_len]) for s in starts])  # [num, seq_len]


@torch.inference_mode()
def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, calibration_text: str, opts: QuantizeOptions) -> dict:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    arch = ArchConfig.from_hf(model_dir)
    if arch.quantization_config:
        raise ValueError(f"{model_dir} is already quantized")
    if opts.method not in ("gptq", "rtn") or opts.bits not in (4, 8):
        raise ValueError(f"method must be gptq or rtn and bits 4 or 8, got {opts.method}, {opts.bits}")
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"), max_position=opts.seq_len)
    tokenizer = Tokenizer(model_dir)
    ids = calibration_windows(tokenizer, calibration_text, opts.num_samples, opts.seq_len)
    backend = DenseCausalBackend(opts.seq_len)
    positions = torch.arange(opts.seq_len).repeat(len(ids))
    rope = model.model.rotary.cos_sin(positions, torch.float32)
    hidden, residual = model.model.embed_tokens(ids.flatten()), None
    packed: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(tqdm(model.model.layers, desc=f"{opts.method} {opts.bits}-bit", unit="layer")):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, Linear)}
        hessians = {name: HessianAccumulator(m.in_features) for name, m in linears.items()}
        hooks = [m.register_forward_pre_hook(lambda mod, args, h=hessians[name]: h.add(args[0]))
                 for name, m in linears.items()]
        with forward_context(backend, None, [None] * len(model.model.layers)):
            layer(rope, hidden.clone(), None if residual is None else residual.clone())
        for hook in hooks:
            hook.remove()
        for name, m in linears.items():
            H = hessians[name].H if opts.method == "gptq" else torch.eye(m.in_features, dtype=torch.float64)
            q = gptq_quantize(m.weight.data, H, opts.bits, opts.group_size, symmetric=True,
                              damp=opts.damp, act_order=opts.act_order and opts.method == "gptq")
            codes, zeros = q.q + 2 ** (opts.bits - 1), q.zero + 2 ** (opts.bits - 1)  # unsigned, as GPTQ stores
            m.weight.data.copy_((codes - zeros[:, q.g_idx.long()]).float() * q.scale.half().float()[:, q.g_idx.long()])
            module = name.rsplit(".", 1)
            shards = SHARD_NAMES.get(module[-1], (module[-1],))
            row = 0
            for shard, size in zip(shards, m.output_sizes):
                prefix = f"model.layers.{i}.{module[0]}.{shard}" if len(module) > 1 else f"model.layers.{i}.{shard}"
                rows = slice(row, row + size)
                for key, t in gptq_pack(codes[rows], zeros[rows], q.scale[rows], q.g_idx, opts.bits).items():
                    packed[f"{prefix}.{key}"] = t.clone()  # shards share g_idx: one copy each on disk
                if m.bias is not None:
                    packed[f"{prefix}.bias"] = m.bias.data[rows].half()
                row += size
        with forward_context(backend, None, [None] * len(model.model.layers)):  # quantized layer -> next inputs
            hidden, residual = layer(rope, hidden, residual)

    # everything that is not a quantized linear is copied as it is in the source checkpoint
    quantized_prefixes = {k.rsplit(".", 1)[0] for k in packed}
    for file in find_weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.rsplit(".", 1)[0] not in quantized_prefixes:
                    packed[name] = f.get_tensor(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(packed, out_dir / "model.safetensors", metadata={"format": "pt"})
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy(f, out_dir / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": opts.bits, "group_size": opts.group_size,
                                     "desc_act": opts.act_order and opts.method == "gptq", "sym": True,
                                     "checkpoint_format": "gptq", "damp_percent": opts.damp,
                                     "dabba_method": opts.method}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return config["quantization_config"]
