"""GPTQ against round-to-nearest on the same layer and calibration data."""
from __future__ import annotations

import pytest
import torch

from dabba.quantization.gptq import GPTQWeight, HessianAccumulator, gptq_quantize
from dabba.quantization.rtn import quantize


def calibration(in_features: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Correlated activations with uneven channel scales, as real hidden states have; ``seed``
    draws other tokens of the same distribution."""
    g = torch.Generator().manual_seed(1234)
    mix = torch.randn(in_features, in_features, generator=g) / in_features**0.5
    scales = torch.exp(torch.randn(in_features, generator=g))
    tokens_g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, in_features, generator=tokens_g) @ mix) * scales


def reconstruction_error(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ w.T - x @ wq.T) ** 2).mean())


@pytest.mark.parametrize("bits, group_size, symmetric, act_order", [
    (4, 128, False, False), (4, 32, False, False), (4, 128, False, True), (8, 256, True, False), (3, 64, False, True),
])
def test_gptq_beats_rtn_on_layer_reconstruction(bits, group_size, symmetric, act_order) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    x = calibration(256, 2048)
    acc = HessianAccumulator(256)
    for chunk in x.split(300):  # fed in batches, as layer-by-layer calibration does
        acc.add(chunk)
    assert torch.allclose(acc.H, 2 * x.double().T @ x.double() / len(x))
    gptq = gptq_quantize(w, acc.H, bits, group_size, symmetric, act_order=act_order)
    rtn = quantize(w, bits, group_size, symmetric).dequantize()
    test_x = calibration(256, 1024, seed=1)  # the same distribution, unseen tokens
    e_gptq, e_rtn = reconstruction_error(w, gptq.dequantize(), test_x), reconstruction_error(w, rtn, test_x)
    assert e_gptq < 0.8 * e_rtn, f"GPTQ {e_gptq:.3e} vs RTN {e_rtn:.3e}"


def test_gptq_codes_follow_the_group_formula() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 128) * 0.05
    gptq = gptq_quantize(w, HessianAccumulator(128).H + torch.eye(128, dtype=torch.float64), 4, 32, act_order=True)
    assert gptq.q.min() >= 0 and gptq.q.max() <= 15
    assert sorted(torch.bincount(gptq.g_idx).tolist()) == [32, 32, 32, 32]
    expected = (gptq.q - gptq.zero[:, gptq.g_idx]).float() * gptq.scale[:, gptq.g_idx]
    assert torch.equal(gptq.dequantize(), expected)
    # with an identity Hessian there is nothing to compensate: GPTQ is round-to-nearest
    plain = gptq_quantize(w, torch.eye(128, dtype=torch.float64), 4, 32)
    assert torch.equal(plain.dequantize(), quantize(w, 4, 32, symmetric=False).dequantize())
    assert isinstance(plain, GPTQWeight)
