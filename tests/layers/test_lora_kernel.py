"""The native LoRA products (csrc/lora_cpu.cpp) against layers/lora.py's PyTorch reference: rows
of three adapters in no order, unused slots, a shard's unused ranks; float32 to float rounding,
bf16 within one rounding of the reference's intermediate sums."""
from __future__ import annotations

import pytest
import torch

from dabba.layers.lora import StepRows, add_lora_reference
from dabba.ops.native import load_cpu_ops

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="native CPU kernels cannot be built here")


def case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots, ranks, n_in, n_out, tokens = 4, 24, 70, 53, 19
    a = (torch.randn(slots, ranks, n_in, generator=g) * 0.3).to(dtype)
    bt = (torch.randn(slots, ranks, n_out, generator=g) * 0.3).to(dtype)
    bt[:, 8:16] = 0  # a shard's ranks its adapter leaves unused
    x = torch.randn(tokens, n_in, generator=g).to(dtype)
    y = torch.randn(tokens, n_out, generator=g).to(dtype)
    order = torch.randperm(tokens, generator=g)
    segments = [(3, order[:7]), (0, order[7:9]), (2, order[9:15])]  # slot 1 unused; rows 15.. the base model's
    return y, x, a, bt, StepRows.of(segments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_equals_reference(dtype) -> None:
    y, x, a, bt, rows = case(dtype)
    want, got = y.clone(), y.clone()
    add_lora_reference(want, x, a, bt, rows)
    torch.ops.dabba_cpu.lora_add(got, x, a, bt, rows.rows, rows.slots)
    untouched = torch.ones(len(y), dtype=torch.bool)
    untouched[rows.rows] = False
    assert torch.equal(got[untouched], y[untouched])  # the base model's rows
    assert not torch.equal(got, y)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a float32 sum in another order may round t or the delta to the neighbouring bf16
        diff = (got.float() - want.float()).abs()
        assert (diff > 0).float().mean() < 0.05 and diff.max() <= 2 ** -6 * want.float().abs().max()


def test_bad_arguments_refused() -> None:
    y, x, a, bt, rows = case(torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.dabba_cpu.lora_add(y, x, a, bt, rows.rows, rows.slots + 4)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.dabba_cpu.lora_add(y, x, a.bfloat16(), bt, rows.rows, rows.slots)
