"""W8A8's kernels (csrc/w8a8_cpu.cpp) against the PyTorch reference (quantization/w8a8.py): the
same int32 sums and float steps, so equal bit for bit on every path this build and CPU run."""
from __future__ import annotations

import pytest
import torch

from dabba.ops import native
from dabba.ops.activation import act_and_mul
from dabba.quantization.rtn import quantize_rows
from dabba.quantization.w8a8 import pack_weight, quantize_activations, row_range, w8a8_linear, w8a8_reference

pytestmark = pytest.mark.skipif(not native.load_cpu_ops(), reason="native kernels unavailable")

PATHS = ["amx", "vnni", "avx2", "scalar"]


def available_paths() -> list[str]:
    return [p for p in PATHS if torch.ops.dabba_cpu.w8a8_path_available(p)]


def make_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.2, 2.0, n)[:, None]
    qw = quantize_rows(w, 8, k, symmetric=True, codes_dtype=torch.int8)
    return qw.q, qw.scale[:, 0]


def run(x, codes, scales, bias, asymmetric, path):
    return w8a8_linear(x, pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32), scales, bias,
                       asymmetric, path)


@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("rows, n, k", [(1, 48, 64), (3, 37, 100), (8, 130, 256), (17, 64, 1100), (40, 33, 2100),
                                        (70, 96, 192), (131, 80, 96)])
def test_every_path_equals_the_reference_bit_for_bit(rows, n, k, asymmetric) -> None:
    codes, scales = make_weight(n, k, seed=rows)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) + 0.3).to(dtype)
        bias = torch.randn(n).to(dtype)
        ref = w8a8_reference(x, codes, scales, bias, asymmetric)
        for path in available_paths():
            got = run(x, codes, scales, bias, asymmetric, path)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert torch.equal(got, ref), (path, dtype, (got.float() - ref.float()).abs().max().item())


@pytest.mark.parametrize("zero", [0, -20, 37])
def test_a_static_scale_equals_the_reference_bit_for_bit(zero) -> None:
    """A checkpoint's one activation scale and zero point for every row; some values clip at -128 / 127."""
    codes, scales = make_weight(40, 200, seed=5)
    packed, wsum = pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32)
    input_scale, input_zero = torch.tensor([0.013]), torch.tensor([zero], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(21, 200, generator=torch.Generator().manual_seed(3)) * 0.6).to(dtype)
        u, s, z = quantize_activations(x, False, input_scale, input_zero)
        assert (u == 0).any() and (u == 255).any() and z.tolist() == [zero + 128] * 21
        ref = w8a8_reference(x, codes, scales, None, False, input_scale, input_zero)
        for path in available_paths():
            got = w8a8_linear(x, packed, wsum, scales, None, False, path, input_scale, input_zero)
            assert torch.equal(got, ref), (path, dtype)
        exact = x.float().clamp((-128 - zero) * 0.013, (127 - zero) * 0.013) @ (codes.float() * scales[:, None]).T
        assert (ref.float() - exact).abs().max().item() < 0.02 * exact.abs().max().item()


def test_a_bad_static_scale_is_refused() -> None:
    codes, scales = make_weight(16, 64, seed=2)
    packed, wsum = pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32)
    x = torch.randn(2, 64)
    for scale, zero, match in ((torch.tensor([0.0]), None, "positive"), (torch.tensor([0.1, 0.2]), None, "one float"),
                               (torch.tensor([0.1]), torch.tensor([200], dtype=torch.int32), "-128..127"),
                               (None, torch.tensor([1], dtype=torch.int32), "without input_scale")):
        with pytest.raises(RuntimeError, match=match):
            w8a8_linear(x, packed, wsum, scales, None, False, "", scale, zero)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_row_parallel_slices_rounded_by_the_whole_row_sum_to_the_whole_layer(asymmetric) -> None:
    """Tensor parallelism's row-parallel layers: each rank holds a slice of every row's inputs. Rounded
    by the whole row's range (gathered), the ranks' codes are the unsharded layer's, and their outputs
    add up to its output but for the float additions; rounded by their own slice's, they would not."""
    codes, scales = make_weight(48, 256, seed=7)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(8))
    x[:, 200] *= 20  # one rank's slice holds each row's largest value
    whole = w8a8_reference(x, codes, scales, None, asymmetric)
    x_range = row_range(x)
    halves = [slice(0, 128), slice(128, 256)]
    for path in available_paths():
        parts = [w8a8_linear(x[:, h].contiguous(), pack_weight(codes[:, h].contiguous()),
                             codes[:, h].to(torch.int32).sum(1, dtype=torch.int32), scales, None, asymmetric, path,
                             x_range=x_range) for h in halves]
        for h, part in zip(halves, parts):
            assert torch.equal(part, w8a8_reference(x[:, h], codes[:, h], scales, None, asymmetric, x_range=x_range))
        assert (parts[0] + parts[1] - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()
    local = sum(w8a8_reference(x[:, h], codes[:, h], scales, None, asymmetric) for h in halves)
    assert (local - whole).abs().max().item() > 1e-3 * whole.abs().max().item()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 5, 17, 70])
def test_the_fused_gated_epilogue_equals_the_layer_then_the_activation(act, rows) -> None:
    """A merged [gate; up] layer with act(gate) * up applied as the sums are stored: the plain layer's
    outputs, then silu_and_mul / gelu_tanh_and_mul, bit for bit (bias, asymmetric and static included)."""
    codes, scales = make_weight(2 * 48, 300, seed=rows)
    packed, wsum = pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, 300, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
        bias = torch.randn(96).to(dtype)
        for asymmetric, static in ((False, None), (True, None), (False, torch.tensor([0.02]))):
            ref = act_and_mul(w8a8_reference(x, codes, scales, bias, asymmetric, static), act)
            for path in available_paths():
                got = w8a8_linear(x, packed, wsum, scales, bias, asymmetric, path, static, act=act)
                assert got.shape == (rows, 48) and torch.equal(got, ref), (path, dtype, asymmetric, static is None)


def test_a_gated_layer_needs_whole_blocks_in_each_half() -> None:
    codes, scales = make_weight(2 * 24, 64, seed=1)
    with pytest.raises(RuntimeError, match="whole blocks"):
        w8a8_linear(torch.randn(2, 64), pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32), scales,
                    None, False, act="silu")
    with pytest.raises(RuntimeError, match="act must be"):
        w8a8_linear(torch.randn(2, 64), pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32), scales,
                    None, False, act="relu")


def test_the_chosen_path_is_one_of_those_available() -> None:
    for rows in (1, 8, 64, 512):
        assert torch.ops.dabba_cpu.w8a8_path(rows, 1024) in available_paths()


def test_rounding_is_close_to_the_float_product() -> None:
    codes, scales = make_weight(64, 512, seed=1)
    x = torch.randn(5, 512)
    exact = x @ (codes.float() * scales[:, None]).T
    for asymmetric in (False, True):
        got = run(x, codes, scales, None, asymmetric, "")
        assert (got - exact).abs().max().item() < 0.02 * exact.abs().max().item()


def test_activation_codes() -> None:
    x = torch.tensor([[1.27, -0.635, 0.0, 0.005], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 1.0, 1.0]])
    u, s, z = quantize_activations(x, asymmetric=False)
    assert u[0].tolist() == [255, 64, 128, 128] and z.tolist() == [128, 128, 128]  # -63.5 -> -64 (half to even)
    assert u[1].tolist() == [128] * 4 and s[1].item() == 0.0
    u, s, z = quantize_activations(x, asymmetric=True)
    assert z[2].item() == 0 and u[2].tolist() == [255, 128, 128, 128]  # the range includes 0
    assert u[0].min().item() == 0 and u[0].max().item() == 255


def test_all_zero_rows_give_zero_or_the_bias() -> None:
    codes, scales = make_weight(16, 64, seed=2)
    x = torch.zeros(2, 64)
    bias = torch.randn(16)
    for path in available_paths():
        for asymmetric in (False, True):
            assert torch.equal(run(x, codes, scales, bias, asymmetric, path), bias.expand(2, 16))


def test_bad_operands_are_refused() -> None:
    codes, scales = make_weight(16, 64, seed=3)
    packed, wsum = pack_weight(codes), codes.to(torch.int32).sum(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="holds 64 inputs"):
        w8a8_linear(torch.randn(1, 128), packed, wsum, scales, None, False)
    with pytest.raises(RuntimeError, match="packed int8"):
        w8a8_linear(torch.randn(1, 64), codes, wsum, scales, None, False)
    with pytest.raises(RuntimeError, match="unknown path"):
        w8a8_linear(torch.randn(1, 64), packed, wsum, scales, None, False, "sse")
    with pytest.raises(RuntimeError, match="bias"):
        w8a8_linear(torch.randn(1, 64), packed, wsum, scales, torch.randn(3), False)
