"""GGUF's quantized tensors as a linear method: the weight stays in the file's blocks, and every
forward reads them there (csrc/gguf_linear_cpu.cpp on the CPU), so a Q4_K_M model holds and
streams its 4.5-6.5 bits a weight, never a bf16 copy.

A layer's weight is a list of segments of output rows in checkpoint order, each of one GGUF type:
a merged qkv or gate_up layer gets one per shard (a Q4_K_M file keeps some v and down rows in
Q6_K), and a shard the file stores as F32/F16/BF16 is a segment of those bytes. The kernels take
them as one byte buffer (``blob``) and a table ``segments`` [S, 3] int64 of (type, rows, byte
offset).

The reference, in PyTorch, is ``linear_reference``: for up to the GEMV's rows, x rounded to 8-bit
codes with a scale max|x| / 127 per block of 32 values for the legacy types (held as float16), of
256 for the K types (float32) (``quantize_activations``), times the dequantized weight, in float64;
beyond, the same where the CPU's GEMM multiplies those codes in integers (AVX512-VNNI without AMX),
elsewhere x as the codes give it back (``rounded_activations``) and dequantized weights through
F.linear; either way a row's result does not depend on how many rows share its step. Off the CPU,
or without the native kernels, ``apply`` does the latter at any row count.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dabba.ops import native
from dabba.ops.host_memory import huge_page_bytes
from dabba.quantization.base import LinearMethod, NativeLinearSpec
from dabba.quantization.gguf_blocks import BLOCKS, dequantize, row_bytes
from dabba.quantization.gguf_repack import LAYOUTS, file_type, layout_for, repack, unpack

FLOAT_TYPES = ("F32", "F16", "BF16")
A8_BLOCK = 32  # activation values per scale (csrc/gguf_linear_cpu.cpp's kA8Block), legacy types
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # their activations (and their layouts'): a scale per super-block (kSuperBlock)


@dataclass(frozen=True)
class GGUFBlocks:
    """A checkpoint tensor as the file holds it: ``data`` uint8 [rows, row bytes] of ``type_name``
    blocks, for a logical [rows, columns] weight; or, once loaded, in one of dabba's layouts of
    those blocks (gguf_repack.py), named by ``type_name``."""

    type_name: str
    data: torch.Tensor
    columns: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.type_name, self.data, self.columns, dtype)

    def narrow_rows(self, start: int, length: int) -> "GGUFBlocks":
        return GGUFBlocks(self.type_name, self.data.narrow(0, start, length), self.columns)

    def narrow_columns(self, start: int, length: int) -> "GGUFBlocks":
        """Columns start .. start + length: whole blocks only (a row-parallel rank's inputs)."""
        if self.type_name in LAYOUTS:
            raise ValueError(f"a {self.type_name} tensor's columns are cut before it is repacked")
        block, size = BLOCKS[self.type_name]
        if start % block or length % block:
            raise ValueError(f"a {self.type_name} tensor cannot be cut inside its blocks of {block} columns "
                             f"(columns {start} to {start + length})")
        return GGUFBlocks(self.type_name, self.data.narrow(1, start // block * size, length // block * size), length)


def dequantize_rows(type_name: str, raw: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """GGUF rows [rows, row bytes] -> [rows, columns] in ``dtype``: the native kernel where there is
    one (parallel, no float32 temporaries of the whole tensor), else the reference."""
    constants = native.kernel_constants() if raw.device.type == "cpu" else None
    if constants is not None and type_name in constants.gguf_types and dtype in (torch.bfloat16, torch.float32):
        return torch.ops.dabba_cpu.gguf_dequantize(raw.contiguous(), constants.gguf_types[type_name], columns, dtype)
    if type_name in LAYOUTS:
        raw = unpack(type_name, raw, columns)
    return dequantize(file_type(type_name), raw, (raw.shape[0], columns)).to(dtype)


def quantize_activations(x: torch.Tensor, block: int = A8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> codes [M, K'] int8 and scales [M, K' / block] float32 (x ~ code * scale), K' = K
    rounded up to ``block``, rounded code for code as llama.cpp's x86 kernels round activations (half
    to even): per block of 32 (the legacy types) codes x * (127 / max|x|) and scale max|x| / 127, held
    as float16 (quantize_row_q8_0); per 256 (the K types) codes x * (-127 / x_m), x_m the block's
    first value of the largest magnitude, and scale 1 / (-127 / x_m) (quantize_row_q8_K)."""
    m, k = x.shape
    padded = -(-k // block) * block
    xf = F.pad(x.float(), (0, padded - k)).view(m, -1, block)
    amax = xf.abs().amax(-1)
    # tensor / tensor: a scalar over a tensor (or a tensor over a scalar) is computed with a reciprocal,
    # rounded twice, which moves the codes of x at halves away from the kernels'
    full = functools.partial(torch.full_like, amax)
    if block == A8_BLOCK:
        scale = torch.where(amax > 0, full(127.0) / amax, full(0.0))
        d = (amax / full(127.0)).half().float()
    else:
        xm = xf.gather(-1, xf.abs().argmax(-1, keepdim=True)).squeeze(-1)  # argmax: the first of the largest
        scale = torch.where(amax > 0, full(-127.0) / xm, full(0.0))
        d = torch.where(amax > 0, full(1.0) / scale, full(0.0))
    q = torch.round(xf * scale[..., None]).clamp(-127, 127)
    return q.to(torch.int8).view(m, padded), d


def rounded_activations(x: torch.Tensor, type_name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x as the 8-bit codes a segment of ``type_name`` multiplies give it back (q * d), in ``dtype``
    (x's by default; float64 holds the products exactly); x itself for a float segment."""
    if type_name in FLOAT_TYPES:
        return x
    block = 256 if file_type(type_name) in K_TYPES else A8_BLOCK
    q, d = quantize_activations(x, block)
    m, k = x.shape
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(wide).view(m, -1, block) * d.to(wide)[..., None]).view(m, -1)[:, :k].to(dtype or x.dtype)


def dequantized_linear(x: torch.Tensor, segments: list[GGUFBlocks], bias: torch.Tensor | None) -> torch.Tensor:
    """Prefill's and batches' GGUF linear in PyTorch: each segment's dequantized rows against x
    rounded as that segment's type rounds it (once per kind of rounding: a merged layer's segments
    mostly share one)."""
    rounded: dict[str, torch.Tensor] = {}
    outs = []
    for s in segments:
        kind = "float" if s.type_name in FLOAT_TYPES else "k" if file_type(s.type_name) in K_TYPES else "legacy"
        if kind not in rounded:
            rounded[kind] = rounded_activations(x, s.type_name)
        outs.append(F.linear(rounded[kind], s.dequantize(x.dtype)))
    y = torch.cat(outs, dim=1)
    return y if bias is None else y + bias


def linear_reference(x: torch.Tensor, segments: list[GGUFBlocks], bias: torch.Tensor | None,
                     gemv_max_rows: int, integer_gemm: bool = False) -> torch.Tensor:
    """What gguf_linear computes: x [M, K] against the segments' rows, in x's dtype; up to
    ``gemv_max_rows`` rows (dabba.ops.native.gguf_gemv_max_rows(K) of the build) as the GEMV does,
    and beyond them too where the build's GEMM multiplies the codes in integers
    (``integer_gemm``: native.integer_gemm_usable(K)); otherwise as ``dequantized_linear``."""
    k = x.shape[1]
    if x.shape[0] > gemv_max_rows and not integer_gemm:
        return dequantized_linear(x, segments, bias)
    rounded = {}  # activation block -> x as its codes give it back
    for block in (A8_BLOCK, 256):
        q, d = quantize_activations(x, block)
        rounded[block] = (q.double().view(x.shape[0], -1, block) * d.double()[..., None]).view(x.shape[0], -1)[:, :k]
    outs = []
    for s in segments:
        w = s.dequantize().double()
        block = 256 if file_type(s.type_name) in K_TYPES else A8_BLOCK
        a = x.double() if s.type_name in FLOAT_TYPES else rounded[block]
        outs.append(a @ w.T)
    y = torch.cat(outs, dim=1).float().to(x.dtype)  # float32 sums, rounded to x's dtype
    return y if bias is None else y + bias


class GGUFLinearMethod(LinearMethod):
    """A linear whose checkpoint tensors are GGUF blocks: each shard arrives as a GGUFBlocks and is
    held as it came; a shard the file keeps as F32/F16/BF16 beside quantized ones arrives as a
    float32 tensor and is held as F32 (its values exactly)."""

    packs_embedding_rows = True  # a tied table stays in the file's blocks, looked up row by row

    def __init__(self, shard_types: list[str]) -> None:
        self.shard_types = shard_types  # per merged shard, as the file has it ("F32" for a float one)
        self.native = False  # set once packed: on the CPU, every segment of a type the kernels take
        # a row-parallel rank's inputs must be whole blocks: Linear refuses, naming the layer, a
        # split inside one before loading (the types' blocks, of 1, 32 or 256 values, nest)
        self.group_size = max(BLOCKS[t][0] for t in shard_types)

    def create_weights(self, layer: nn.Module) -> None:
        layer.add_param("weight", torch.empty(0), output_dim=None)
        layer.weight.weight_loader = functools.partial(self.load_shard, layer)
        layer.gguf_shards = {}  # merged shard index -> GGUFBlocks (this rank's part)

    def load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: GGUFBlocks | torch.Tensor,
                   shard_id=None) -> None:
        if not isinstance(loaded, GGUFBlocks):  # a float shard: its float32 values' bytes
            if loaded.dim() != 2:
                raise ValueError(f"{layer.prefix}: checkpoint tensor {tuple(loaded.shape)} is not a matrix")
            values = loaded.float().contiguous()
            loaded = GGUFBlocks("F32", values.view(torch.uint8).view(values.shape[0], -1), values.shape[1])
        if shard_id is None and layer.shard_ids:  # a fused tensor: every shard's rows
            start = 0
            for idx, size in enumerate(layer.full_output_sizes):
                self._store(layer, loaded.narrow_rows(start, size), idx)
                start += size
            if start != loaded.rows:
                raise ValueError(f"{layer.prefix}: checkpoint tensor has {loaded.rows} rows, expected {start}")
            return
        if shard_id is not None and (layer.shard_ids is None or shard_id not in layer.shard_ids):
            raise ValueError(f"{layer.prefix}: unknown shard {shard_id!r}")
        self._store(layer, loaded, 0 if shard_id is None else layer.shard_ids.index(shard_id))

    def _store(self, layer: nn.Module, t: GGUFBlocks, idx: int) -> None:
        start, size = layer.output_slices[idx]
        expected = (layer.full_output_sizes[idx], layer.full_in_features)
        if (t.rows, t.columns) != expected:
            raise ValueError(f"{layer.prefix}: checkpoint tensor {(t.rows, t.columns)} != expected {expected}")
        if layer.parallel == "column":
            t = t.narrow_rows(start, size)
        elif layer.parallel == "row":
            t = t.narrow_columns(layer.input_offset, layer.in_features)
        layer.gguf_shards[idx] = t

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = [layer.gguf_shards[i] for i in range(len(layer.output_sizes))]  # a Linear's, or an LMHead's one
        del layer.gguf_shards
        types = native.kernel_constants().gguf_types if native.load_cpu_ops() else {}
        # one buffer on 2 MiB pages: the GEMV streams it every step (ops/host_memory.py); a layout
        # keeps a shard's bytes a row, so each shard's part is written in it straight from the file's
        total = sum(s.data.numel() for s in shards)
        blob = huge_page_bytes(total) if shards[0].data.device.type == "cpu" else torch.empty(
            total, dtype=torch.uint8, device=shards[0].data.device)
        table, names, offset = [], [], 0
        for s in shards:
            part = blob[offset:offset + s.data.numel()].view_as(s.data)
            name = self._layout(s, types)
            if name is None:
                part.copy_(s.data)
            else:
                repack(name, s.data, s.columns, out=part)
            names.append(name or s.type_name)
            table.append((types.get(names[-1], -1), s.rows, offset))
            offset += s.data.numel()
        layer.gguf_segment_types = names
        self.native = blob.device.type == "cpu" and all(name in types for name in names)
        layer.register_buffer("gguf_blob", blob, persistent=False)
        layer.register_buffer("gguf_segments", torch.tensor(table, dtype=torch.int64), persistent=False)
        del layer.weight
        layer.register_parameter("weight", None)

    @staticmethod
    def _layout(shard: GGUFBlocks, types: dict[str, int]) -> str | None:
        """The layout the kernels take for the shard's type and width, None for the file's blocks."""
        layout = layout_for(shard.type_name, shard.columns)
        if layout is None or layout not in types or shard.data.device.type != "cpu":
            return None
        return layout

    def segments(self, layer: nn.Module) -> list[GGUFBlocks]:
        """The layer's segments as GGUFBlocks over its blob (the reference's operands)."""
        out = []
        for type_name, (_, rows, offset) in zip(layer.gguf_segment_types, layer.gguf_segments.tolist()):
            nbytes = rows * row_bytes(file_type(type_name), layer.in_features)
            out.append(GGUFBlocks(type_name, layer.gguf_blob[offset:offset + nbytes].view(rows, -1), layer.in_features))
        return out

    def packed_bytes(self, layer: nn.Module, dtype: torch.dtype, device_type: str) -> int:
        return sum(row_bytes(t, layer.in_features) * rows for t, rows in zip(self.shard_types, layer.output_sizes))

    def embedding_rows(self, layer: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        rows = self.segments(layer)[0]  # an LM head is one segment
        return lambda ids: dequantize_rows(rows.type_name, rows.data[ids], rows.columns, dtype)

    def native_spec(self, layer: nn.Module) -> NativeLinearSpec | None:
        return NativeLinearSpec("gguf", layer.gguf_blob, layer.gguf_segments) if self.native else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.native and native.native_rows(x2) and x2.dtype in (torch.bfloat16, torch.float32):
            y = torch.ops.dabba_cpu.gguf_linear(x2, layer.gguf_blob, layer.gguf_segments, bias)
        else:
            y = dequantized_linear(x2, self.segments(layer), bias)
        return y.view(*shape[:-1], -1)
