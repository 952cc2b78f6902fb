"""dabba's INT4 kernels (csrc/int4_linear_cpu.cpp: the GEMV up to int4_gemv_max_rows rows of x, on
AVX-512 with x rounded to 8-bit codes as the GGUF GEMV rounds it, or AVX2; beyond, the AMX GEMM
where the CPU has AMX and x is bf16, without AMX tiles the integer GEMM on the GEMV's codes of x)
against the exact product of the dequantized weight and against PyTorch's tinygemm, which they
replace."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dabba.ops import native
from dabba.quantization.gguf import rounded_activations


def packed_weight(n: int, k: int, group_size: int, dtype: torch.dtype, seed: int):
    """Random codes in PyTorch's packed int4 CPU layout, tinygemm's (scale, zero) pairs, and the
    weight they mean, (q - 8) * scale + zero, in float64."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    scale = torch.rand(n, k // group_size, generator=g) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group_size), generator=g).float()
    scale_zero = torch.stack([scale, (8 - zero) * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
    s = scale_zero.double()
    weight = ((codes.double() - 8).view(n, -1, group_size) * s[..., 0].t().unsqueeze(-1)
              + s[..., 1].t().unsqueeze(-1)).view(n, k)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), scale_zero, weight


def pytorch_block_rows() -> int:
    """PyTorch packs blocks of 64 rows at its AVX-512 capability, each k's byte i holding rows i and
    32 + i, and of 32 at AVX2 (ATEN_CPU_CAPABILITY=avx2), rows i and 16 + i."""
    codes = (torch.arange(64, dtype=torch.int32) // 4).view(64, 1).expand(64, 4).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).view(-1)
    return 64 if packed[1].item() == codes[1, 0] | codes[33, 0] << 4 else 32


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 33, 100])  # (2048 rows of K 1536: 4 chunks)
@pytest.mark.parametrize("n, k, group_size, dtype", [
    (128, 256, 32, torch.bfloat16), (192, 512, 64, torch.float32), (64, 128, 128, torch.float32),
    (2048, 1536, 128, torch.bfloat16), (96, 256, 64, torch.bfloat16), (96, 256, 64, torch.float32),
])  # 96: not whole 64-row blocks (whole 32-row ones, which PyTorch packs at AVX2)
def test_int4_linear_equals_the_dequantized_product(rows, n, k, group_size, dtype) -> None:
    if not native.load_cpu_ops():
        pytest.skip("native kernels unavailable")
    packed, scale_zero, weight = packed_weight(n, k, group_size, dtype, seed=n + k + rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    exact = x.double() @ weight.t() + bias.double()
    ours = torch.ops.dabba_cpu.int4_linear(x, packed, group_size, scale_zero, bias, True)
    tinygemm = torch.ops.dabba_cpu.int4_linear(x, packed, group_size, scale_zero, bias, False)
    assert ours.dtype == tinygemm.dtype == dtype and ours.shape == (rows, n)
    constants = native.kernel_constants()
    if rounds_activations(n, k, rows, group_size, dtype):  # x as its 8-bit codes give it back
        exact = rounded(x) @ weight.t() + bias.double()
    # bf16: the output's rounding (2^-8 relative) dominates (the AMX GEMM also rounds the dequantized
    # weight to bf16); float32: the sums' (the avx2 GEMV's byte sums less 16x the high nibbles' cost a
    # few bits of float32's 24)
    tolerance = (2**-7 if dtype == torch.bfloat16 else 2e-5) * exact.abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= tolerance
    assert (tinygemm.double() - (x.double() @ weight.t() + bias.double())).abs().max().item() <= tolerance
    amx = dtype == torch.bfloat16 and native.amx_usable(k)
    if n % pytorch_block_rows() or (rows > constants.int4_gemv_max_rows and not amx and
                                    not rounds_activations(n, k, rows, group_size, dtype)):
        assert torch.equal(ours, tinygemm)  # tinygemm takes these (the GEMV reads whole blocks)


def rounds_activations(n: int, k: int, rows: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether int4_linear multiplies these operands' x rounded to 8-bit codes per 32 values (the GGUF
    GEMV's legacy rounding): the AVX-512 GEMV, and past it, for bf16 x, the integer GEMM where the
    CPU has no AMX tiles."""
    return native.loaded_variant() == "avx512" and pytorch_block_rows() == 64 and n % 64 == 0 and \
        group_size % 32 == 0 and (rows <= native.kernel_constants().int4_gemv_max_rows or
                                  (dtype == torch.bfloat16 and native.integer_gemm_usable(k)))


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the AVX-512 GEMV's 8-bit codes give it back, in float64."""
    return rounded_activations(x, "Q8_0", torch.float64)


@pytest.mark.skipif(native.loaded_variant() != "avx2" or pytorch_block_rows() != 64,
                    reason="not the avx2 build on a CPU where PyTorch packs 64-row blocks")
def test_avx2_gemv_where_pytorch_packs_32_row_blocks() -> None:
    """The avx2 build's GEMV reads the 32-row blocks PyTorch packs at its AVX2 capability (a CPU
    without AVX-512) and leaves 64-row ones to PyTorch's AVX-512 tinygemm: where PyTorch runs
    AVX-512, this module runs again with PyTorch held to AVX2, so that the kernel is tested here too."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", __file__],
                         cwd=root, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
