"""The GGUF kernels (csrc/gguf_linear_cpu.cpp) against their PyTorch reference
(dabba/quantization/gguf.py): dequantization bit for bit, the GEMV's 8-bit-activation products
within float32 rounding, the dequantized GEMM path within bf16's, for every type the kernels take,
merged segments of mixed types, and bad operands refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dabba.ops import native
from dabba.quantization.gguf import GGUFBlocks, linear_reference, quantize_activations
from dabba.quantization.gguf_blocks import BLOCKS, dequantize
from dabba.quantization.gguf_repack import LAYOUTS, file_type, unpack
from tools.random_gguf import random_blocks

pytestmark = pytest.mark.skipif(not native.load_cpu_ops(), reason="native CPU kernels unavailable")
gemv_max_rows = native.gguf_gemv_max_rows  # of an input width: the GEMV up to here, the GEMM beyond
integer_gemm = native.integer_gemm_usable  # whether that GEMM multiplies x's codes as the GEMV does

TYPES = [*BLOCKS, *LAYOUTS]


def native_linear(x: torch.Tensor, segments: list[GGUFBlocks], bias: torch.Tensor | None = None) -> torch.Tensor:
    types = native.kernel_constants().gguf_types
    blob = torch.cat([s.data.reshape(-1) for s in segments])
    table, offset = [], 0
    for s in segments:
        table.append((types[s.type_name], s.rows, offset))
        offset += s.data.numel()
    return torch.ops.dabba_cpu.gguf_linear(x, blob, torch.tensor(table), bias)


def columns_for(type_name: str) -> list[int]:
    if type_name == "Q6_Kx1":  # runs of one super-block
        return [768, 1024]
    if type_name in ("Q4_0x16", "Q5_0x16", "Q8_0x16"):  # a run and a partial run of 3 blocks, or of 12 (past one half of 8); two runs
        return [512 + 3 * 32, 896, 1024]
    if type_name in LAYOUTS:  # a run of 512 values and a super-block past it; two runs
        return [512 + 256, 1024]
    block = BLOCKS[type_name][0]
    return [512, 768] if block == 256 else [96, 256 + 64]  # 96: a group of fewer than 8 blocks


@pytest.mark.parametrize("type_name", TYPES)
def test_native_dequantization_is_the_reference_bit_for_bit(type_name) -> None:
    blocks = random_blocks(type_name, 19, columns_for(type_name)[1], seed=1)
    raw = unpack(type_name, blocks.data, blocks.columns) if type_name in LAYOUTS else blocks.data
    ref = dequantize(file_type(type_name), raw, (blocks.rows, blocks.columns))
    id_ = native.kernel_constants().gguf_types[type_name]
    ours = torch.ops.dabba_cpu.gguf_dequantize(blocks.data, id_, blocks.columns, torch.float32)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    ours16 = torch.ops.dabba_cpu.gguf_dequantize(blocks.data, id_, blocks.columns, torch.bfloat16)
    assert torch.equal(ours16, ref.to(torch.bfloat16))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_gemv_equals_the_reference_in_float32(type_name, rows) -> None:
    for k in columns_for(type_name):
        w = random_blocks(type_name, 37, k, seed=rows)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 2
        ref = linear_reference(x, [w], None, gemv_max_rows(k), integer_gemm(k))
        ours = native_linear(x, [w])
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 2e-6 * scale * k ** 0.5, (type_name, k)
        # and the 8-bit activations cost little against the exact product
        exact = F.linear(x.double(), w.dequantize().double()).float()
        assert (ours - exact).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("type_name", ["Q4_0x16", "Q6_Kx1"])
def test_gemv_passes_meet_weight_rows_held_in_l2(type_name) -> None:
    """More weight rows than a thread holds at once (its block of 128 KiB) against several passes of
    x, the last one partial: every pass meets every block, as the reference."""
    k = 2048
    w = random_blocks(type_name, 600, k, seed=11)
    rows = min(13, gemv_max_rows(k))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(11))
    ref = linear_reference(x, [w], None, gemv_max_rows(k), integer_gemm(k))
    assert (native_linear(x, [w]) - ref).abs().max().item() <= 2e-6 * ref.abs().max().item() * k ** 0.5


def test_activation_codes_round_as_the_kernel_does() -> None:
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, 2.5, -127.0] + [0.0] * 26 + [0.0] * 31 + [3.0]])
    q, d = quantize_activations(x)
    assert d.tolist() == [[1.0, float(np.float16(np.float32(3.0) / np.float32(127.0)))]]  # float16, as llama.cpp
    assert q[0, :6].tolist() == [127, 0, 0, 2, 2, -127]  # half to even
    assert q[0, 63].item() == 127 and q[0, 32:63].abs().sum().item() == 0


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_gemv_rounds_blocks_of_zeros_and_halves_as_the_reference(type_name) -> None:
    """x's blocks are rounded 16 at a time where the CPU has AVX-512 (the legacy types' blocks of 32;
    a K type's super-block's 16 sums), one at a time past them: a block of zeros (scale 0, codes 0)
    and codes at a half (to even) in both, as the reference."""
    block = 256 if type_name == "Q4_K" else 32
    k = 1024 + 3 * block  # legacy: two groups of 16 blocks, then 3 one at a time
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    x[:, 3 * block:4 * block] = 0
    x[:, k - 2 * block:k - block] = 0  # past the groups
    halves = torch.tensor([-127.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.5] + [0.5] * (block - 7))
    x[0, block:2 * block] = halves  # scale 1: every code sits at a half
    x[1, k - block:] = halves
    w = random_blocks(type_name, 64, k, seed=5)
    ours = native_linear(x, [w])
    ref = linear_reference(x, [w], None, gemv_max_rows(k), integer_gemm(k))
    tol = 2e-6 * ref.abs().max().item() * k ** 0.5
    assert (ours - ref).abs().max().item() <= tol
    off = x.clone()  # a code one step from its half's even neighbour would be seen
    off[0, block + 1] = 0.5001
    off[1, k - block + 1] = 0.5001
    assert ((linear_reference(off, [w], None, gemv_max_rows(k), integer_gemm(k)) - ours).abs().amax(dim=1) > tol).all()


@pytest.mark.parametrize("rows", [1, 3, 9, 40, "past the GEMV"])
def test_merged_segments_of_mixed_types_with_a_bias(rows) -> None:
    k = 512
    rows = gemv_max_rows(k) + 3 if rows == "past the GEMV" else rows
    segments = [random_blocks("Q4_K", 24, k, 1), random_blocks("Q6_K", 8, k, 2), random_blocks("F32", 5, k, 3),
                random_blocks("Q8_0", 16, k, 4), random_blocks("Q4_0x16", 8, k, 5), random_blocks("Q4_Kx2", 8, k, 6),
                random_blocks("Q6_Kx1", 8, k, 7)]
    bias = torch.randn(77)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        ref = linear_reference(x, segments, bias.to(dtype), gemv_max_rows(k), integer_gemm(k))
        ours = native_linear(x, segments, bias.to(dtype))
        assert ours.dtype == dtype and ours.shape == (rows, 77)
        tol = 2e-3 if dtype == torch.float32 else 2e-2
        assert (ours.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q4_K", "Q6_K"])
def test_prefill_rows_stay_near_the_bf16_product(type_name) -> None:
    """Past the GEMV (either GEMM), within bf16's rounding of the unrounded product."""
    k = columns_for(type_name)[0]
    w = random_blocks(type_name, 70, k, seed=5)
    x = torch.randn(gemv_max_rows(k) + 1, k).to(torch.bfloat16)
    ref = F.linear(x, w.dequantize(torch.bfloat16))
    assert torch.allclose(native_linear(x, [w]).float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_bad_operands_are_refused() -> None:
    w = random_blocks("Q4_0", 4, 64, seed=0)
    x = torch.randn(1, 64)
    q4_0 = native.kernel_constants().gguf_types["Q4_0"]
    blob = w.data.reshape(-1)
    with pytest.raises(RuntimeError, match="lies outside"):
        torch.ops.dabba_cpu.gguf_linear(x, blob, torch.tensor([[q4_0, 5, 0]]), None)
    with pytest.raises(RuntimeError, match="not one the kernels take"):
        torch.ops.dabba_cpu.gguf_linear(x, blob, torch.tensor([[10, 4, 0]]), None)  # Q2_K
    with pytest.raises(RuntimeError, match="whole Q4_0 blocks"):
        torch.ops.dabba_cpu.gguf_linear(torch.randn(1, 48), blob, torch.tensor([[q4_0, 1, 0]]), None)
    with pytest.raises(RuntimeError, match="lies outside"):
        torch.ops.dabba_cpu.gguf_linear(x, blob, torch.tensor([[q4_0, 1, -18]]), None)
    with pytest.raises(RuntimeError, match="overlaps or precedes"):
        torch.ops.dabba_cpu.gguf_linear(x, blob, torch.tensor([[q4_0, 2, 36], [q4_0, 2, 0]]), None)


@pytest.mark.skipif(not native.load_cpu_ops(), reason="native kernels unavailable")
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16",
                                       *LAYOUTS])
def test_a_row_gives_the_same_result_alone_and_in_a_batch(type_name) -> None:
    """The GEMM (past the GEMV's rows) multiplies the activations' 8-bit codes as the GEMV does, and
    the GEMV's passes of rows each their own: a row's result alone, among 40 and among more than the
    GEMV takes differs by float32 summation order only, far below what the codes' rounding itself
    moves (checked against x unrounded)."""
    k = 512 + 32 if file_type(type_name) not in ("Q4_K", "Q5_K", "Q6_K") else 768  # blocks past a whole group
    seg = random_blocks(type_name, 48, k, 7)
    rows = max(40, gemv_max_rows(k) + 5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, k)
    batched = native_linear(x, [seg])
    alone = torch.cat([native_linear(x[i:i + 1], [seg]) for i in range(x.shape[0])])
    unrounded = F.linear(x, seg.dequantize())
    scale = unrounded.abs().max().item()
    assert (batched - alone).abs().max().item() <= 2e-6 * scale
    assert (native_linear(x[:40], [seg]) - alone[:40]).abs().max().item() <= 2e-6 * scale
    if type_name != "F16":
        assert (batched - unrounded).abs().max().item() > 100 * (batched - alone).abs().max().item()


@pytest.mark.skipif(not native.load_cpu_ops() or not integer_gemm(512), reason="no integer GEMM in this build or CPU")
@pytest.mark.parametrize("type_name", TYPES)
def test_integer_gemm_equals_the_reference(type_name) -> None:
    """Past the GEMV's rows, the integer GEMM: x's codes as the GEMV rounds them times the blocks'
    codes, each sub-block's sum scaled in float32, for every type and layout; 37 channels (a panel of
    32 and one of 5) and a last pass of 3 rows; in bfloat16 with a bias, rounded as the reference."""
    for k in columns_for(type_name):
        w = random_blocks(type_name, 37, k, seed=4)
        rows = gemv_max_rows(k) + 7
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + 1)) * torch.linspace(0.2, 3, k)
        ref = linear_reference(x, [w], None, gemv_max_rows(k), True)
        ours = native_linear(x, [w])
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 2e-6 * scale * k ** 0.5, (type_name, k)
        bias = torch.randn(37).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        ref16 = linear_reference(xb, [w], bias, gemv_max_rows(k), True)
        ours16 = native_linear(xb, [w], bias)
        assert ours16.dtype == torch.bfloat16
        assert (ours16.float() - ref16.float()).abs().max().item() <= 2 ** -7 * ref16.float().abs().max().item()
