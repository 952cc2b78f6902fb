"""`dabba quantize`: GPTQ, AWQ, round-to-nearest, W8A8 or SmoothQuant + W8A8 over a whole checkpoint,
one decoder layer at a time. GPTQ and RTN are saved in AutoGPTQ's layout (symmetric codes,
checkpoint_format "gptq"), AWQ in AutoAWQ's "gemm" layout (asymmetric codes), W8A8 as compressed-tensors'
int-quantized checkpoint (quantization/compressed_tensors_writer.py: INT8 per channel; activations per token
at run time, or with static scales from the calibration inputs' range), with SmoothQuant's scales
folded in first (tools/smoothquant.py) for "smoothquant".

Layer by layer: the calibration hidden states go through layer L with its full-precision
weights while hooks collect what each linear sees (GPTQ: its Hessian; AWQ: its inputs); the
layer is quantized; then the same inputs go through the quantized layer to give layer L+1 its
inputs. So each layer is calibrated on what the quantized model below it really produces, and
only one layer's statistics are held.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dabba.arch.config import GEMMA_ARCHITECTURES, ArchConfig
from dabba.arch.files import read_json_object
from dabba.attention.backend import forward_context
from dabba.attention.dense import DenseCausalBackend
from dabba.engine.tokenizer import Tokenizer
from dabba.layers.fused_moe import FusedMoE
from dabba.layers.linear import Linear
from dabba.models.loader import find_weight_files, load_model, open_safetensors
from dabba.models.moe import STACKED_EXPERTS
from dabba.quantization import compressed_tensors as ct
from dabba.quantization import compressed_tensors_writer as ct_writer
from dabba.quantization.awq import awq_clip_layer, awq_scale_layer
from dabba.quantization.formats import awq_pack, gptq_pack
from dabba.quantization.gptq import HessianAccumulator, gptq_quantize
from dabba.quantization.rtn import quantize
from dabba.tools.smoothquant import smooth_layer, smoothed_pairs

logger = logging.getLogger("dabba")

# checkpoint names of the shards of each merged layer, in their order
SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "gptq"  # or "rtn", "awq", "w8a8" (compressed-tensors), "smoothquant" (then w8a8)
    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    num_samples: int = 64  # calibration windows
    seq_len: int = 256
    damp: float = 0.01
    awq_search_tokens: int = 4096  # rows the AWQ scale grid is evaluated on (whole windows)
    static_activations: bool = False  # w8a8: one activation scale per layer from calibration (else per token)
    asymmetric_activations: bool = False  # w8a8: activation codes with a zero point
    alpha: float = 0.5  # smoothquant: the migration strength (tools/smoothquant.py)

    @property
    def w8a8(self) -> bool:
        """Written as compressed-tensors W8A8 (smoothquant smooths first)."""
        return self.method in ("w8a8", "smoothquant")

    @property
    def w8a8_scheme(self) -> ct.W8A8Scheme:
        return ct.W8A8Scheme("channel", static=self.static_activations, asymmetric=self.asymmetric_activations)


def calibration_windows(tokenizer: Tokenizer, text: str, num: int, seq_len: int) -> torch.Tensor:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one window of {seq_len}")
    starts = torch.linspace(0, len(ids) - seq_len, steps=min(num, len(ids) // seq_len)).long()
    return torch.stack([torch.tensor(ids[s:s + seq_len]) for s in starts])  # [num, seq_len]


@dataclass
class LayerCodes:
    """One quantized linear, ready to pack: unsigned codes and zero points, as both formats store them."""
    codes: torch.Tensor  # [out, in] in [0, 2^bits)
    zeros: torch.Tensor  # [out, groups]
    scales: torch.Tensor  # [out, groups] (fp16 on disk)
    g_idx: torch.Tensor  # [in] group of each input channel

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.codes - self.zeros[:, g]).float() * self.scales.half().float()[:, g]


def quantize_linear(weight: torch.Tensor, hessian: torch.Tensor | None, opts: QuantizeOptions) -> LayerCodes:
    """GPTQ with the layer's Hessian; RTN (symmetric for the GPTQ format, asymmetric for AWQ's) without one."""
    if opts.method == "awq":
        q = quantize(weight, opts.bits, opts.group_size, symmetric=False)
        g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // opts.group_size
        return LayerCodes(q.q, q.zero, q.scale, g_idx)
    H = hessian if hessian is not None else torch.eye(weight.shape[1], dtype=torch.float64)
    q = gptq_quantize(weight, H, opts.bits, opts.group_size, symmetric=True, damp=opts.damp,
                      act_order=opts.act_order and hessian is not None)
    offset = 2 ** (opts.bits - 1)  # GPTQ stores unsigned codes
    return LayerCodes(q.q + offset, q.zero + offset, q.scale, q.g_idx)


def pack_linear(prefix: str, layer: Linear, codes: LayerCodes, opts: QuantizeOptions) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one (possibly merged) linear, split back into its shards."""
    module = prefix.rsplit(".", 1)
    shards = SHARD_NAMES.get(module[1], (module[1],))
    tensors, row = {}, 0
    for shard, size in zip(shards, layer.output_sizes):
        rows = slice(row, row + size)
        if opts.method == "awq":
            packed = awq_pack(codes.codes[rows], codes.zeros[rows], codes.scales[rows])
        else:
            packed = gptq_pack(codes.codes[rows], codes.zeros[rows], codes.scales[rows], codes.g_idx, opts.bits)
        for key, t in packed.items():
            tensors[f"{module[0]}.{shard}.{key}"] = t.clone()  # shards share g_idx: one copy each on disk
        if layer.bias is not None:
            tensors[f"{module[0]}.{shard}.bias"] = layer.bias.data[rows].half()
        row += size
    return tensors


def compress_w8a8(prefix: str, layer: Linear, opts: QuantizeOptions,
                  inputs: ct_writer.ActivationRange | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One (possibly merged) linear as compressed-tensors' tensors, split back into its shards
    (which share ``inputs``, their one input's range), and the weight they dequantize to."""
    module, name = prefix.rsplit(".", 1)
    tensors, row, parts = {}, 0, []
    for shard, size in zip(SHARD_NAMES.get(name, (name,)), layer.output_sizes):
        shard_tensors = ct_writer.compress_linear(f"{module}.{shard}", layer.weight.data[row:row + size],
                                                  opts.w8a8_scheme, inputs)
        parts.append(ct_writer.dequantized_weight(shard_tensors, f"{module}.{shard}"))
        tensors.update(shard_tensors)
        row += size
    return tensors, torch.cat(parts)


def quantized_linears(layer: torch.nn.Module) -> dict[str, Linear]:
    """A decoder layer's linears that quantization replaces: all but a mixture of experts' router,
    which stays in the checkpoint's precision (as the engine keeps it)."""
    routers = {f"{name}.gate" for name, m in layer.named_modules() if isinstance(m, FusedMoE)}
    return {name: m for name, m in layer.named_modules() if isinstance(m, Linear) and name not in routers}


def checkpoint_name(arch: ArchConfig, name: str) -> str:
    """dabba's name of a layer's tensor as the family's checkpoints spell it: Mixtral's experts are
    block_sparse_moe.experts.{e}.w1 / w3 / w2 (dabba.models.moe reads either)."""
    if arch.architecture != "MixtralForCausalLM" or ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
        name = name.replace(ours, theirs)
    return name


def check_options(model_dir: Path, arch: ArchConfig, opts: QuantizeOptions) -> None:
    if arch.quantization_config:
        raise ValueError(f"{model_dir} is already quantized")
    if opts.method not in ("gptq", "rtn", "awq", "w8a8", "smoothquant") or opts.bits not in (4, 8):
        raise ValueError(f"method must be gptq, rtn, awq, w8a8 or smoothquant and bits 4 or 8, got {opts.method}, "
                         f"{opts.bits}")
    if opts.w8a8 and (opts.bits != 8 or opts.act_order):
        raise ValueError("bits, act_order: W8A8 holds 8-bit codes per channel, rounded to nearest")
    if (opts.static_activations or opts.asymmetric_activations) and not opts.w8a8:
        raise ValueError("activations: static or asymmetric activations are W8A8's (--method w8a8 or smoothquant)")
    if not 0.0 <= opts.alpha <= 1.0:
        raise ValueError(f"alpha: SmoothQuant's migration strength must be in [0, 1], got {opts.alpha}")
    if opts.static_activations and arch.moe is not None:
        raise ValueError(f"activations: static scales need every expert's inputs, and calibration may route no token "
                         f"to some of {arch.architecture}'s experts; use dynamic activations")
    if opts.method == "awq":
        if arch.architecture in GEMMA_ARCHITECTURES:
            raise ValueError(f"method: AWQ folds its scales into the RMSNorm before each linear, and dabba's AWQ "
                             f"knows only the Llama block, not {arch.architecture}'s (1 + w) and post-norms; "
                             "use --method gptq or rtn")
        if arch.moe is not None:
            raise ValueError(f"method: dabba's AWQ knows the dense Llama block, not {arch.architecture}'s experts; "
                             "use --method gptq or rtn")
        if opts.bits != 4:
            raise ValueError("bits: AWQ's gemm format holds 4-bit codes only")
        widths = {arch.hidden_size, arch.intermediate_size, arch.num_attention_heads * arch.head_dim}
        if any(w % opts.group_size for w in widths):
            raise ValueError(f"group_size: AWQ needs every layer width ({sorted(widths)}) to be a multiple of "
                             f"{opts.group_size}")


@torch.inference_mode()
def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, calibration_text: str, opts: QuantizeOptions) -> dict:
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    arch = ArchConfig.from_hf(model_dir)
    check_options(model_dir, arch, opts)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"), max_position=opts.seq_len)
    calibrating = opts.method != "w8a8" or opts.static_activations  # plain dynamic W8A8 rounds to nearest: no inputs
    ids = (calibration_windows(Tokenizer(model_dir), calibration_text, opts.num_samples, opts.seq_len) if calibrating
           else torch.zeros(0, opts.seq_len, dtype=torch.long))
    backend = DenseCausalBackend(opts.seq_len)
    positions = torch.arange(opts.seq_len).repeat(len(ids))
    rope = model.model.rotary.cos_sin(positions, torch.float32)
    hidden, residual = model.model.embed_tokens(ids.flatten()), None
    packed: dict[str, torch.Tensor] = {}
    changed: dict[str, torch.Tensor] = {}  # AWQ folds its scales into the norms
    unreached = 0  # experts no calibration token was routed to: round-to-nearest instead of GPTQ
    with forward_context(backend, [None], [None] * len(model.model.layers)):
        for i, layer in enumerate(tqdm(model.model.layers, desc=f"{opts.method} {opts.bits}-bit", unit="layer")):
            linears = quantized_linears(layer)
            hessians = {name: HessianAccumulator(m.in_features) for name, m in linears.items()
                        if opts.method == "gptq"}
            ranges = {name: ct_writer.ActivationRange() for name in linears if opts.static_activations}
            inputs: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
            absmax: dict[str, torch.Tensor] = {}  # smoothquant: per input channel

            def record(name: str, x: torch.Tensor) -> None:
                if opts.method == "gptq":
                    hessians[name].add(x)
                elif opts.method == "awq":
                    inputs[name].append(x.clone())
                elif opts.method == "smoothquant" and not absmax_done:
                    seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
                    absmax[name] = torch.maximum(absmax[name], seen) if name in absmax else seen
                elif name in ranges:
                    ranges[name].observe(x)
            absmax_done = False
            hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: record(name, args[0]))
                     for name, m in linears.items()]
            if calibrating:
                layer(rope, hidden.clone(), None if residual is None else residual.clone())
            if opts.method == "smoothquant":  # fold the scales in; static ranges are then the smoothed inputs'
                smooth_layer(layer, absmax, opts.alpha)
                names = {module: name for name, module in layer.named_modules()}
                for norm, _ in smoothed_pairs(layer):
                    changed[f"model.layers.{i}.{names[norm]}.weight"] = norm.weight.data
                absmax_done = True
                if ranges:
                    layer(rope, hidden.clone(), None if residual is None else residual.clone())
            for hook in hooks:
                hook.remove()
            if opts.method == "awq":
                search_tokens = max(1, opts.awq_search_tokens // opts.seq_len) * opts.seq_len
                captured = {k: torch.cat(v) for k, v in inputs.items()}
                awq_scale_layer(layer, captured, rope, opts.bits, opts.group_size, search_tokens)
                awq_clip_layer(layer, captured, opts.bits, opts.group_size)
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    changed[f"model.layers.{i}.{norm}.weight"] = getattr(layer, norm).weight.data
            for name, m in linears.items():
                if opts.w8a8:
                    tensors, dequantized = compress_w8a8(f"model.layers.{i}.{name}", m, opts, ranges.get(name))
                    m.weight.data.copy_(dequantized)
                    packed.update({checkpoint_name(arch, k): v for k, v in tensors.items()})
                    continue
                hessian = hessians[name].H if name in hessians and hessians[name].num_samples else None
                if name in hessians and hessian is None:
                    unreached += 1
                codes = quantize_linear(m.weight.data, hessian, opts)
                m.weight.data.copy_(codes.dequantize())
                packed.update({checkpoint_name(arch, k): v
                               for k, v in pack_linear(f"model.layers.{i}.{name}", m, codes, opts).items()})
            if calibrating:
                hidden, residual = layer(rope, hidden, residual)  # the quantized layer feeds the next one

    # everything else is copied from the source checkpoint (AWQ's scaled norms in the source dtype);
    # a merged layer's source may be its shards or one fused tensor (Phi-3's qkv_proj, gate_up_proj),
    # a mixture's experts one stacked tensor (transformers 5), which the quantized experts replace
    if unreached:
        logger.info("%d expert projections saw no calibration token and were rounded to nearest (no Hessian)",
                    unreached)
    quantized_prefixes = {k.rsplit(".", 1)[0] for k in packed} | {
        checkpoint_name(arch, f"model.layers.{i}.{name}") for i, layer in enumerate(model.model.layers)
        for name in quantized_linears(layer)}
    for file in find_weight_files(model_dir):
        with open_safetensors(file) as f:
            for name in f.keys():
                keep_bias = opts.w8a8 and name.endswith(".bias")  # compressed-tensors keeps it as it is
                if (name.rsplit(".", 1)[0] not in quantized_prefixes or keep_bias) and not STACKED_EXPERTS.match(name):
                    t = f.get_tensor(name)
                    packed[name] = changed[name].to(t.dtype) if name in changed else t
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(packed, out_dir / "model.safetensors", metadata={"format": "pt"})
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy(f, out_dir / f.name)
    config = read_json_object(model_dir / "config.json")
    if opts.w8a8:  # the head and the routers stay in the checkpoint's precision
        routers = [checkpoint_name(arch, f"model.layers.{i}.{name}.gate") for i, layer in enumerate(model.model.layers)
                   for name, m in layer.named_modules() if isinstance(m, FusedMoE)]
        qc = ct_writer.quantization_config(opts.w8a8_scheme, ["lm_head", *routers])
    elif opts.method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": opts.group_size, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "gptq", "bits": opts.bits, "group_size": opts.group_size,
              "desc_act": opts.act_order and opts.method == "gptq", "sym": True, "checkpoint_format": "gptq",
              "damp_percent": opts.damp, "dabba_method": opts.method}
        if arch.moe is not None and opts.method == "gptq":
            qc["dabba_rtn_projections"] = unreached  # expert projections calibration never reached
    config["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return qc
