"""compressed-tensors checkpoints (what llm-compressor writes and vLLM loads): W8A8 INT8, read and written.

config.json's ``quantization_config``, the one scheme dabba takes::

    {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"type": "int", "num_bits": 8, "symmetric": true, "strategy": "channel" | "tensor"},
         "input_activations": {"type": "int", "num_bits": 8, "symmetric": true | false,
                               "dynamic": true, "strategy": "token"  |  "dynamic": false, "strategy": "tensor"}}},
     "ignore": ["lm_head", "re:.*mlp.gate$"]}

and the tensors of each quantized linear NAME (a checkpoint module: q_proj, not dabba's merged qkv_proj)::

    NAME.weight            int8 [out, in]   codes q, symmetric: w = q * weight_scale
    NAME.weight_scale      [out, 1] ("channel") or [1] ("tensor"), any float dtype
    NAME.input_scale       [1]              static activations: x ~ (q - zp) * s,
                                                q = clamp(round(x / s) + zp, -128, 127)
    NAME.input_zero_point  int8 [1]         static asymmetric activations only (zp; symmetric: 0, not stored)

"naive-quantized" is the package's older name for the same storage (its IntQuantizationCompressor
subclasses NaiveQuantizationCompressor: codes in the args' integer dtype, int8). Everything else
the format can say (weight zero points, groups, blocks, 4-bit packing, float8, output or KV-cache
quantization, sparsity, transforms) is refused with a ValueError naming the field: never converted.

Layers are matched as compressed-tensors matches modules (utils/match.py): a target or ignore entry
is a module name, "re:" and a regex re.match-ed against it, or the class name "Linear"; among a
layer's matching targets the exact names come first, then regexes, then "Linear". dabba's merged
layers (qkv_proj, gate_up_proj) take the scheme of their checkpoint shards, which must agree.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dabba.arch.checkpoint_names import shard_checkpoint_names
from dabba.quantization.base import LinearMethod, NativeLinearSpec, UnquantizedLinearMethod
from dabba.quantization.w8a8 import W8A8Method, packing

QUANT_METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")  # int8 codes on disk, either name
# QuantizationArgs' fields (compressed-tensors 0.20; the package forbids any other)
ARGS_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
               "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
SCHEME_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
# the package's preset schemes for W8A8 (quant_scheme.py: INT8_W8A8), a config group named by one
PRESETS = {"W8A8": {"weights": {"strategy": "channel"}, "input_activations": {"strategy": "token", "dynamic": True}}}
PRESETS["INT8"] = PRESETS["W8A8"]
# Mixtral's checkpoints call dabba's mlp.experts.{e}.gate_proj/up_proj/down_proj block_sparse_moe.experts.{e}.w1/w3/w2
MIXTRAL_SPELLING = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class W8A8Scheme:
    """One config group's quantization: INT8 weights, symmetric, a scale per output channel
    ("channel") or per tensor ("tensor"); INT8 activations per token at run time (dynamic) or with
    the checkpoint's one scale per layer (static), with a zero point where asymmetric."""

    weight_strategy: str = "channel"
    static: bool = False
    asymmetric: bool = False

    def config_group(self, targets: list[str]) -> dict[str, Any]:
        """This scheme as a config group of config.json (the fields compressed-tensors writes)."""
        inputs: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": not self.asymmetric, "group_size": None,
                                  "strategy": "tensor" if self.static else "token", "dynamic": not self.static}
        if self.static:  # how the scales were calibrated (llm-compressor's observer of the same name)
            inputs["observer"] = "static_minmax"
        return {"targets": list(targets), "format": "int-quantized", "output_activations": None,
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                            "strategy": self.weight_strategy, "dynamic": False},
                "input_activations": inputs}


def _args(where: str, args: Any) -> dict[str, Any]:
    """A QuantizationArgs dict with the package's defaults filled in and its strategy inferred as
    the package infers it (group_size None: "tensor", -1: "channel", > 0: "group")."""
    if not isinstance(args, dict):
        raise ValueError(f"{where}: expected an object of quantization arguments, got {args!r}")
    unknown = sorted(set(args) - ARGS_FIELDS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a compressed-tensors quantization argument")
    out = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": None,
           "block_structure": None, "dynamic": False, "actorder": None, **args}
    if out["strategy"] is None:
        out["strategy"] = {None: "tensor", -1: "channel"}.get(out["group_size"], "group")
    out["strategy"] = str(out["strategy"]).lower()
    for key, want in (("type", "int"), ("num_bits", 8), ("group_size", None), ("block_structure", None)):
        value = str(out[key]).lower() if key == "type" else out[key]
        if value != want and not (key == "group_size" and value == -1 and out["strategy"] == "channel"):
            raise ValueError(f"{where}.{key}: {out[key]!r} is not supported (dabba reads INT8 W8A8: "
                             f"{key} {want!r}); 4-bit, float8, group and block quantization are refused")
    return out


def parse_scheme(where: str, group: dict[str, Any]) -> W8A8Scheme:
    """A config group -> its W8A8Scheme, or a ValueError naming the field it cannot take."""
    unknown = sorted(set(group) - SCHEME_FIELDS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field of a compressed-tensors quantization scheme")
    if group.get("format") is not None and group["format"] not in FORMATS:
        raise ValueError(f"{where}.format: {group['format']!r} is not supported (supported: {', '.join(FORMATS)})")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations: output quantization is not supported")
    if group.get("weights") is None:
        raise ValueError(f"{where}.weights: a scheme without weight quantization is not supported")
    if group.get("input_activations") is None:
        raise ValueError(f"{where}.input_activations: weight-only schemes are not supported (dabba reads W8A8)")
    weights = _args(f"{where}.weights", group["weights"])
    if weights["symmetric"] is not True:
        raise ValueError(f"{where}.weights.symmetric: {weights['symmetric']!r}: weight zero points are not supported")
    if weights["strategy"] not in ("channel", "tensor"):
        raise ValueError(f"{where}.weights.strategy: {weights['strategy']!r} is not supported ('channel', 'tensor')")
    if weights["dynamic"] is not False:
        raise ValueError(f"{where}.weights.dynamic: {weights['dynamic']!r}: weights carry their scales")
    if weights["actorder"] not in (None, "weight", "static"):  # "weight": a calibration order only
        raise ValueError(f"{where}.weights.actorder: {weights['actorder']!r} is not supported")
    inputs = _args(f"{where}.input_activations", group["input_activations"])
    dynamic, strategy = inputs["dynamic"], inputs["strategy"]
    if (dynamic, strategy) not in ((True, "token"), (False, "tensor")):
        raise ValueError(f"{where}.input_activations: dynamic {dynamic!r} with strategy {strategy!r} is not "
                         "supported (dynamic true with 'token', or false with 'tensor')")
    if inputs.get("zp_dtype") not in (None, "torch.int8", "int8") and not inputs["symmetric"]:
        raise ValueError(f"{where}.input_activations.zp_dtype: {inputs['zp_dtype']!r}: zero points are int8")
    return W8A8Scheme(weights["strategy"], static=not dynamic, asymmetric=not inputs["symmetric"])


def _match_name(name: str, target: str) -> bool:
    """compressed-tensors' match_name: a "re:" regex re.match-ed against the name, else the exact name."""
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _is_class_name(target: str) -> bool:
    """A target naming a module class (Linear, Embedding), not a module: no dots, capitalised."""
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def spellings(name: str) -> list[str]:
    """A checkpoint module name in dabba's spelling and, for an expert, Mixtral's (w1/w3/w2)."""
    m = MIXTRAL_SPELLING.search(name)
    if m is None:
        return [name]
    alt = f"{name[:m.start()]}.block_sparse_moe.experts.{m.group(1)}.{MIXTRAL_NAMES[m.group(2)]}"
    return [name, alt]


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A checkpoint's compressed-tensors quantization_config, parsed: each target's scheme (a later
    group's wins for a target two groups name, as the package's target_to_scheme), the ignore list."""

    target_schemes: tuple[tuple[str, W8A8Scheme], ...]
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> "CompressedTensorsConfig":
        if qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method: {qc.get('quant_method')!r} is not {QUANT_METHOD!r}")
        fmt = qc.get("format")
        if fmt not in FORMATS + ("mixed-precision",):
            raise ValueError(f"quantization_config.format: {fmt!r} is not supported (supported: {', '.join(FORMATS)}; "
                             "'dense' checkpoints hold unquantized weights, 'pack-quantized' 4-bit ones)")
        if qc.get("quantization_status") not in (None, "compressed"):
            raise ValueError(f"quantization_config.quantization_status: {qc['quantization_status']!r}: only "
                             "'compressed' checkpoints hold their codes")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
            if qc.get(key):  # None, {} and absent all mean "none"
                raise ValueError(f"quantization_config.{key}: {qc[key]!r} is not supported")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config.config_groups: expected a non-empty object of quantization schemes")
        targets: dict[str, W8A8Scheme] = {}
        for name, group in groups.items():
            where = f"quantization_config.config_groups.{name}"
            if isinstance(group, list):  # a preset's name and its targets
                if name not in PRESETS:
                    raise ValueError(f"{where}: preset scheme {name!r} is not supported (supported: {sorted(PRESETS)})")
                group = {"targets": group, **PRESETS[name]}
            if not isinstance(group, dict):
                raise ValueError(f"{where}: expected a quantization scheme, got {group!r}")
            if fmt == "mixed-precision" and group.get("format") is None:
                raise ValueError(f"{where}.format: a mixed-precision checkpoint names each group's format")
            scheme = parse_scheme(where, group)
            group_targets = group.get("targets")
            if not isinstance(group_targets, list) or not group_targets or \
                    not all(isinstance(t, str) for t in group_targets):
                raise ValueError(f"{where}.targets: expected a non-empty list of names, got {group_targets!r}")
            for target in group_targets:
                if _is_class_name(target) and target != "Linear":
                    raise ValueError(f"{where}.targets: {target!r} names a module class dabba does not quantize "
                                     "(supported: 'Linear', module names, 're:' patterns)")
                if target.startswith("re:"):
                    _check_regex(f"{where}.targets", target)
                targets[target] = scheme
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ValueError(f"quantization_config.ignore: expected a list of names, got {ignore!r}")
        for entry in ignore:
            if entry.startswith("re:"):
                _check_regex("quantization_config.ignore", entry)
        config = cls(tuple(targets.items()), tuple(ignore))
        for name in ("lm_head", "model.embed_tokens"):  # the head and the table stay in full precision
            if config.scheme_of(name, linear=name == "lm_head") is not None:
                raise ValueError(f"quantization_config.ignore: {name!r} is quantized by the config (targets "
                                 f"{[t for t, _ in config.target_schemes]}); dabba keeps the LM head and the "
                                 f"embedding in full precision: a checkpoint that quantizes them is not supported")
        return config

    def scheme_of(self, name: str, linear: bool = True) -> W8A8Scheme | None:
        """The scheme of checkpoint module ``name`` (None: not quantized). As the package:
        ignored wins; else the first matching target, exact names before regexes before classes."""
        names = spellings(name)
        if any(_match_name(n, entry) or (linear and entry == "Linear") for n in names for entry in self.ignore):
            return None
        schemes = dict(self.target_schemes)
        for target in sorted(schemes, key=lambda t: (t.startswith("re:"), t)):
            if not _is_class_name(target) and any(_match_name(n, target) for n in names):
                return schemes[target]
        return schemes["Linear"] if linear and "Linear" in schemes else None

    def names_explicitly(self, name: str) -> bool:
        """Whether a target or ignore entry names ``name`` itself (not only by its class)."""
        entries = [t for t, _ in self.target_schemes] + list(self.ignore)
        return any(not _is_class_name(e) and _match_name(n, e) for n in spellings(name) for e in entries)

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        """A dabba layer's method from its checkpoint shards' scheme (a checkpoint that fuses them,
        Phi-3's qkv_proj, names the fused module itself)."""
        names = [layer.prefix]
        if layer.shard_ids and not self.names_explicitly(layer.prefix):
            names = shard_checkpoint_names(layer.prefix, layer.shard_ids)
        schemes = [self.scheme_of(n) for n in names]
        if any(s != schemes[0] for s in schemes):
            raise ValueError(f"quantization_config: {layer.prefix}'s shards {names} are quantized differently "
                             f"({schemes}); dabba computes them as one layer, which needs one scheme "
                             "(check ignore and the config groups' targets)")
        return UnquantizedLinearMethod() if schemes[0] is None else CompressedTensorsW8A8Method(schemes[0])


def _check_regex(where: str, entry: str) -> None:
    try:
        re.compile(entry[3:])
    except re.error as e:
        raise ValueError(f"{where}: {entry!r} is not a valid regular expression ({e})") from None


class CompressedTensorsW8A8Method(LinearMethod):
    """A linear of a compressed-tensors W8A8 checkpoint: the loader fills int8 ``weight``, float32
    ``weight_scale`` [out, 1] (a "tensor" scale spread over its shard's channels) and, static, one
    ``input_scale`` (and ``input_zero_point``) per merged shard; then W8A8Method's kernels take
    them. Under tensor parallelism the codes and their channels' scales shard with the layer (rows
    for column-parallel, input channels for row-parallel, whose scales are the whole row's as
    stored); a per-tensor activation scale is every rank's, and a row-parallel rank rounds dynamic
    rows by the whole row's range (W8A8Method.apply): the codes are the unsharded layer's."""

    def __init__(self, scheme: W8A8Scheme) -> None:
        self.scheme = scheme
        self.w8a8 = W8A8Method(asymmetric=scheme.asymmetric, static=scheme.static)

    def create_weights(self, layer: nn.Module) -> None:
        out, k = layer.out_features, layer.in_features
        _, _, max_inputs = packing()
        if layer.full_in_features > max_inputs:
            raise ValueError(f"{layer.prefix}: W8A8 takes at most {max_inputs} inputs, the layer has "
                             f"{layer.full_in_features}")
        layer.add_param("weight", torch.empty(out, k, dtype=torch.int8), input_dim=1)
        layer.weight.weight_loader = functools.partial(_load_codes, layer)
        layer.add_param("weight_scale", torch.empty(out, 1, dtype=torch.float32))
        layer.weight_scale.weight_loader = functools.partial(_load_weight_scale, layer, self.scheme.weight_strategy)
        if self.scheme.static:
            shards = len(layer.output_sizes)
            names = ("input_scale", "input_zero_point") if self.scheme.asymmetric else ("input_scale",)
            for name, dtype in zip(names, (torch.float32, torch.int32)):
                layer.add_param(name, torch.zeros(shards, dtype=dtype), output_dim=None)
                getattr(layer, name).weight_loader = functools.partial(_load_per_shard, layer, name)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, scales = layer.weight.data, layer.weight_scale.data.reshape(-1)
        input_scale = input_zero = None
        if self.scheme.static:
            zeros = layer.input_zero_point.data if self.scheme.asymmetric else None
            input_scale, input_zero = merge_input_qparams(layer.input_scale.data, zeros)
        for name in ("weight_scale", "input_scale", "input_zero_point"):
            if hasattr(layer, name):
                delattr(layer, name)
        self.w8a8.register(layer, codes, scales, input_scale, input_zero)

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        static = 8 if self.scheme.static else 0  # the activation scale (float32) and zero point (int32)
        return self.w8a8.packed_bytes(layer, dtype, device_type) + static

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.w8a8.apply(layer, x, bias)

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor:
        return self.w8a8.apply_act_and_mul(layer, x, bias, activation)

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return self.w8a8.native_spec(layer)

    def codes(self, layer: nn.Module) -> torch.Tensor:
        """The layer's INT8 codes [out, in] (tests)."""
        return self.w8a8.codes(layer)


def _load_codes(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.dtype != torch.int8:
        raise ValueError(f"{layer.prefix}: weight is {loaded.dtype}; a compressed-tensors int-quantized "
                         "checkpoint stores int8 codes")
    layer.weight_loader(param, loaded, shard_id)


def _load_weight_scale(layer: nn.Module, strategy: str, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id=None) -> None:
    """[out, 1] per channel (also taken as [out]); "tensor": one number, spread over the channels of
    its shard (or, a fused tensor, of the layer) before the rank keeps its part."""
    if strategy == "tensor":
        if loaded.numel() != 1:
            raise ValueError(f"{layer.prefix}: weight_scale of strategy 'tensor' holds one number, got shape "
                             f"{tuple(loaded.shape)}")
        if shard_id is not None and (not layer.shard_ids or shard_id not in layer.shard_ids):
            raise ValueError(f"{layer.prefix}: unknown shard {shard_id!r}")
        channels = (sum(layer.full_output_sizes) if shard_id is None
                    else layer.full_output_sizes[layer.shard_ids.index(shard_id)])
        loaded = loaded.reshape(1, 1).expand(channels, 1)
    elif loaded.dim() == 1:
        loaded = loaded[:, None]
    layer.weight_loader(param, loaded.float(), shard_id)


def _load_per_shard(layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A per-tensor activation scale or zero point into its merged shard's slot (a fused tensor:
    every slot)."""
    if loaded.numel() != 1:
        raise ValueError(f"{layer.prefix}: {name} of strategy 'tensor' holds one number, got shape "
                         f"{tuple(loaded.shape)}")
    value = loaded.reshape(()).double()
    if name == "input_zero_point" and value != value.round():
        raise ValueError(f"{layer.prefix}: input_zero_point must be an integer, got {value.item()}")
    if shard_id is None:
        param.data.fill_(value.item())
    elif layer.shard_ids and shard_id in layer.shard_ids:
        param.data[layer.shard_ids.index(shard_id)] = value.item()
    else:
        raise ValueError(f"{layer.prefix}: unknown shard {shard_id!r}")


def merge_input_qparams(scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One static activation scale [1] (float32) and zero point [1] (int32) for a merged layer
    whose checkpoint shards (q/k/v, gate/up: the same input) each carry their own, as vLLM merges
    them (scaled_mm kernels, process_weights_after_loading): symmetric, the largest scale;
    asymmetric, the range that covers every shard's, [min s (-128 - zp), max s (127 - zp)], over
    255 steps (shards that agree keep their values as stored, not recomputed to within a rounding).
    ``zeros`` None: symmetric."""
    scales = scales.float()
    if zeros is None:  # symmetric
        return scales.max().reshape(1), None
    zeros = zeros.to(torch.int32)
    if bool((scales == scales[0]).all()) and bool((zeros == zeros[0]).all()):
        return scales[:1].clone(), zeros[:1].clone()
    lo = (scales * (-128 - zeros)).min()
    hi = (scales * (127 - zeros)).max()
    scale = (hi - lo) / 255
    return scale.reshape(1), torch.round(-128 - lo / scale).to(torch.int32).reshape(1)
