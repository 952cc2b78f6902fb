"""W8A8: INT8 weights (symmetric, per output channel) times activations rounded to INT8 per row
at run time, multiplied in integers (csrc/w8a8_cpu.cpp: AMX-INT8 tiles, AVX512-VNNI, AVX2).

Each row m of x becomes unsigned codes u with a scale s_m and zero point z_m (symmetric:
q = round(x * 127 / max|x|), u = q + 128, z = 128; asymmetric: over [min(x, 0), max(x, 0)], 255
steps, z = round(-min * 255 / range)); then

    y[m, n] = float(sum_k u[m, k] w[n, k] - z_m * wsum[n]) * (s_m * sw[n])

exactly as the kernels compute it: the int32 sums are exact, and the float steps are the same
operations in the same order, so the reference here and every kernel give the same bits.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.ops import native
from dabba.ops.host_memory import on_huge_pages
from dabba.quantization.base import LinearMethod, NativeLinearSpec


@functools.lru_cache(maxsize=None)
def packing() -> tuple[int, int, int]:
    """(channels per packed block, K's padding multiple, the most inputs) as csrc/cpu_ops.h
    defines them; the same numbers without the kernels, for the reference's layout."""
    constants = native.kernel_constants()
    if constants is None:
        return 16, 64, 32768
    return constants.w8a8_columns, constants.w8a8_depth, constants.w8a8_max_inputs


def quantize_activations(x: torch.Tensor, asymmetric: bool, input_scale: torch.Tensor | None = None,
                         input_zero: torch.Tensor | None = None,
                         x_range: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes u [M, K] int32 in 0..255, scale s [M] float32, zero z [M] int32), as
    csrc/w8a8_cpu.cpp: round_row rounds them (float32 products, half to even). A static
    ``input_scale`` s (float32 [1]) with int8 zero point zp (``input_zero``, int32 [1], compressed-tensors'
    own) rounds every row alike: q = clamp(round(x * (1 / s)) + zp, -128, 127), u = q + 128. ``x_range``
    [M, 2] (min(x, 0), max(x, 0) of each whole row) stands in for x's own where x is a slice of the rows."""
    xf = x.float()
    if input_scale is not None:
        s = input_scale.float().reshape(())
        zp = int(input_zero.item()) if input_zero is not None else 0
        inv = torch.ones((), dtype=torch.float32) / s
        q = (torch.round(xf * inv) + zp).clamp(-128, 127) + 128
        rows = x.shape[0]
        return q.to(torch.int32), s.expand(rows).clone(), torch.full((rows,), zp + 128, dtype=torch.int32)
    lo, hi = row_range(x).unbind(1) if x_range is None else x_range.unbind(1)
    if not asymmetric:
        amax = torch.maximum(hi, -lo)
        scale = amax / 127.0
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        q = torch.round(xf * inv[:, None]).clamp(-127, 127) + 128
        return q.to(torch.int32), scale, torch.full_like(amax, 128, dtype=torch.int32)
    span = hi - lo
    scale = span / 255.0
    inv = torch.where(span > 0, torch.full_like(span, 255.0) / span, torch.zeros_like(span))
    zero = torch.round(-lo * inv).clamp(0, 255)
    q = (torch.round(xf * inv[:, None]) + zero[:, None]).clamp(0, 255)
    return q.to(torch.int32), scale, zero.to(torch.int32)


def row_range(x: torch.Tensor) -> torch.Tensor:
    """[M, 2]: min(x, 0) and max(x, 0) of each row, in float32 (exact: x's own values)."""
    xf = x.float()
    return torch.stack([xf.amin(dim=1).clamp(max=0), xf.amax(dim=1).clamp(min=0)], dim=1)


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                   asymmetric: bool, input_scale: torch.Tensor | None = None,
                   input_zero: torch.Tensor | None = None, x_range: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or float32) times INT8 ``codes`` [N, K] with float32 ``scales`` [N]: what
    w8a8_linear computes, in PyTorch (sums in float64, exact for these integers)."""
    u, s, z = quantize_activations(x, asymmetric, input_scale, input_zero, x_range)
    sums = (u.double() @ codes.double().T).to(torch.int64)  # exact: |sum| < 2^53
    wsum = codes.to(torch.int64).sum(dim=1)
    v = (sums - z.to(torch.int64)[:, None] * wsum[None, :]).float() * (s[:, None] * scales.float()[None, :])
    y = v.to(x.dtype)
    return y + bias if bias is not None else y


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """INT8 codes [N, K] -> the kernels' layout [ceil(N / 16), Kp / 4, 16, 4]: 4 consecutive k of 16
    channels in 64 bytes, K padded with zero codes to Kp (a multiple of 64), N to whole blocks."""
    columns, depth, _ = packing()
    n, k = codes.shape
    np_, kp = -(-n // columns) * columns, -(-k // depth) * depth
    padded = F.pad(codes, (0, kp - k, 0, np_ - n))
    return padded.view(np_ // columns, columns, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``ids`` [T] of the INT8 codes, read out of pack_weight's layout: [T, in_features]."""
    columns = packed.shape[2]
    rows = packed[ids // columns, :, ids % columns, :]  # [T, Kp / 4, 4]
    return rows.reshape(ids.shape[0], -1)[:, :in_features]


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None, asymmetric: bool, path: str = "", input_scale: torch.Tensor | None = None,
                input_zero: torch.Tensor | None = None, x_range: torch.Tensor | None = None,
                act: str = "") -> torch.Tensor:
    """The kernels' entry: ``path`` "" lets csrc/w8a8_cpu.cpp: w8a8_path choose (the one place).
    ``act`` "silu" / "gelu_tanh": a merged [gate; up] layer, act(gate) * up stored as the sums come out."""
    return torch.ops.dabba_cpu.w8a8_linear(x, packed, wsum, scales, bias, asymmetric, path, input_scale, input_zero,
                                           x_range, act)


class W8A8Method(LinearMethod):
    """Load-time W8A8 from a float checkpoint: the weight rounded as INT8 (rtn.Int8RTNMethod's
    codes: symmetric, a scale per output channel of the whole row, at every tensor-parallel size),
    activations rounded per row at run time (or, ``static``, with the checkpoint's one scale per layer)."""

    packs_embedding_rows = True

    def __init__(self, asymmetric: bool = False, static: bool = False) -> None:
        self.asymmetric = asymmetric
        self.static = static

    def whole_tensor_loaded(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is layer.weight:
            layer.row_absmax = loaded.to(param.dtype).float().abs().amax(dim=1, keepdim=True)  # [out, 1]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from dabba.quantization.rtn import quantize_rows

        w = layer.weight.data
        _, _, max_inputs = packing()
        if w.shape[1] > max_inputs:
            raise ValueError(f"{layer.prefix}: W8A8 takes at most {max_inputs} inputs, the layer has {w.shape[1]}")
        qw = quantize_rows(w, 8, w.shape[1], symmetric=True, codes_dtype=torch.int8,
                           r_max=getattr(layer, "row_absmax", None))
        self.register(layer, qw.q, qw.scale[:, 0])

    def register(self, layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor,
                 input_scale: torch.Tensor | None = None, input_zero: torch.Tensor | None = None) -> None:
        """The layer's INT8 codes [out, in] and float32 scales [out] in the kernels' layout (also
        for checkpoints that carry their codes); a static method's activation scale [1] (float32)
        and int8 zero point [1] (int32; None: 0)."""
        if self.static != (input_scale is not None):
            raise ValueError(f"{layer.prefix}: a static W8A8 layer needs its input_scale, a dynamic one has none")
        if input_scale is not None:
            value = float(input_scale.reshape(-1)[0]) if input_scale.numel() == 1 else float("nan")
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{layer.prefix}: input_scale must be one positive number, got {input_scale.tolist()}")
            zero = int(input_zero.reshape(-1)[0]) if input_zero is not None and input_zero.numel() == 1 else 0
            if input_zero is not None and (input_zero.numel() != 1 or not -128 <= zero <= 127):
                raise ValueError(f"{layer.prefix}: input_zero_point must be one integer in -128..127, "
                                 f"got {input_zero.tolist()}")
            layer.register_buffer("w8a8_input_scale", input_scale.float().reshape(1).clone(), persistent=False)
            layer.register_buffer("w8a8_input_zero", torch.tensor([zero], dtype=torch.int32), persistent=False)
        else:
            layer.w8a8_input_scale = layer.w8a8_input_zero = None
        del layer.weight
        layer.register_parameter("weight", None)
        layer.register_buffer("w8a8_codes", codes, persistent=False)  # the reference's operand, off the CPU
        if codes.device.type == "cpu":
            layer.register_buffer("w8a8_packed", on_huge_pages(pack_weight(codes)), persistent=False)
            del layer.w8a8_codes
            layer.w8a8_codes = None
        layer.register_buffer("w8a8_wsum", codes.to(torch.int32).sum(dim=1, dtype=torch.int32), persistent=False)
        layer.register_buffer("w8a8_scales", scales.float().contiguous(), persistent=False)

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        columns, depth, _ = packing()
        n, k = layer.out_features, layer.in_features
        return -(-n // columns) * columns * -(-k // depth) * depth + n * 8  # codes, wsum and scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        x_range = self.whole_row_range(layer, x2)
        if layer.w8a8_codes is None and native.load_cpu_ops() and x2.dtype in (torch.bfloat16, torch.float32):
            y = w8a8_linear(x2.contiguous(), layer.w8a8_packed, layer.w8a8_wsum, layer.w8a8_scales, bias,
                            self.asymmetric, "", layer.w8a8_input_scale, layer.w8a8_input_zero, x_range)
        else:
            y = w8a8_reference(x2, self.codes(layer), layer.w8a8_scales, bias, self.asymmetric,
                               layer.w8a8_input_scale, layer.w8a8_input_zero, x_range)
        return y.view(*shape[:-1], -1)

    def apply_act_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                          activation: str) -> torch.Tensor:
        """The gate_up layer with the activation applied as the kernel stores (no [rows, 2 x
        intermediate] pass through memory), where the kernels run and each half is whole blocks of
        16 channels; it equals apply() then act_and_mul bit for bit."""
        columns, _, _ = packing()
        half = layer.out_features // 2
        if layer.w8a8_codes is not None or not native.load_cpu_ops() or x.dtype not in (torch.bfloat16, torch.float32) \
                or half % columns or layer.out_features != 2 * half:
            return super().apply_act_and_mul(layer, x, bias, activation)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y = w8a8_linear(x2, layer.w8a8_packed, layer.w8a8_wsum, layer.w8a8_scales, bias, self.asymmetric, "",
                        layer.w8a8_input_scale, layer.w8a8_input_zero, self.whole_row_range(layer, x2), activation)
        return y.view(*shape[:-1], half)

    def embedding_rows(self, layer: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        unpacked, packed = layer.w8a8_codes, getattr(layer, "w8a8_packed", None)  # packed on the CPU only
        scales, width = layer.w8a8_scales, layer.in_features

        def rows(ids: torch.Tensor) -> torch.Tensor:
            codes = F.embedding(ids, unpacked) if unpacked is not None else packed_rows(packed, ids, width)
            return (codes.float() * scales[ids, None]).to(dtype)
        return rows

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        """Dynamic rounding on the packed codes, as ``apply`` runs it; none for a static input
        scale, or for a row-parallel shard, whose rounding needs the whole row's range from every
        rank (whole_row_range)."""
        if self.static or layer.parallel == "row" or layer.w8a8_codes is not None:
            return None
        kind = "w8a8_asymmetric" if self.asymmetric else "w8a8"
        return NativeLinearSpec(kind, layer.w8a8_packed, layer.w8a8_scales, sums=layer.w8a8_wsum)

    def whole_row_range(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """A row-parallel shard sees a slice of each row: the whole row's range, gathered from every
        rank, so that its codes are the ones one rank would round (and the sum over ranks is the
        unsharded layer's, up to the float addition of the partial outputs). None elsewhere."""
        if layer.parallel != "row" or self.static:
            return None
        ranges = layer.tp.all_gather(row_range(x))  # [M, 2 * ranks]: (lo, hi) of each rank in turn
        return torch.stack([ranges[:, 0::2].amin(dim=1), ranges[:, 1::2].amax(dim=1)], dim=1).contiguous()

    def codes(self, layer: nn.Module) -> torch.Tensor:
        """The INT8 codes [out, in], unpacked where the layer holds the kernels' layout."""
        if layer.w8a8_codes is not None:
            return layer.w8a8_codes
        blocks, quads, columns, _ = layer.w8a8_packed.shape
        full = layer.w8a8_packed.permute(0, 2, 1, 3).reshape(blocks * columns, quads * 4)
        return full[:layer.out_features, :layer.in_features]
