"""Pack/unpack round trips of the GPTQ and AWQ layouts, against tensors built by hand from the
formats' published descriptions (AutoGPTQ's and AutoAWQ's packing loops)."""
from __future__ import annotations

import torch

from dabba.quantization.formats import (AWQ_ORDER, awq_pack, awq_unpack, gptq_pack, gptq_unpack, pack_rows,
                                        unpack_rows)
from dabba.quantization.rtn import quantize


def test_row_packing_matches_the_reference_loop() -> None:
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (32, 5), dtype=torch.int32)
    packed = pack_rows(codes, 4)
    # AutoGPTQ: qweight[i] |= intweight[j] << (bits * (j - row)) for the 8 rows j of word i
    expected = torch.zeros(4, 5, dtype=torch.int64)
    for i in range(4):
        for k in range(8):
            expected[i] |= codes[i * 8 + k].to(torch.int64) << (4 * k)
    expected = expected - (expected >= 2**31).to(torch.int64) * 2**32
    assert torch.equal(packed, expected.to(torch.int32))
    assert torch.equal(unpack_rows(packed, 4), codes)
    bytes8 = torch.randint(0, 256, (8, 3), dtype=torch.int32)
    assert pack_rows(bytes8, 8).shape == (2, 3)
    assert torch.equal(unpack_rows(pack_rows(bytes8, 8), 8), bytes8)


def test_gptq_round_trip_and_dequantization() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    qw = quantize(w, 4, 128, symmetric=True)
    codes = (qw.q + 8).to(torch.int32)  # GPTQ's symmetric codes are unsigned with zero point 8
    zeros = torch.full_like(qw.zero, 8)
    g_idx = torch.arange(256, dtype=torch.int32) // 128
    t = gptq_pack(codes, zeros, qw.scale, g_idx, 4)
    assert t["qweight"].shape == (32, 64) and t["qzeros"].shape == (2, 8) and t["scales"].shape == (2, 64)
    assert int(t["qzeros"][0, 0]) == 0x77777777  # eight zero points of 8, stored as 7
    c, z, s, g = gptq_unpack(t, 4)
    assert torch.equal(c, codes) and torch.equal(z, zeros) and torch.equal(g, g_idx)
    dequant = (c - z[:, g]).float() * s[:, g]
    assert torch.allclose(dequant, qw.dequantize(), atol=1e-3)  # scales are fp16 in the format


def test_awq_round_trip_and_order() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 256) * 0.05
    qw = quantize(w, 4, 128, symmetric=False)
    t = awq_pack(qw.q, qw.zero, qw.scale)
    assert t["qweight"].shape == (256, 2) and t["qzeros"].shape == (2, 2)
    # AutoAWQ's loop: nibble i of qweight[:, col] holds output col * 8 + order[i]
    intweight = qw.q.T  # [in, out]
    for col in range(2):
        word = torch.zeros(256, dtype=torch.int64)
        for i in range(8):
            word |= intweight[:, col * 8 + AWQ_ORDER[i]].to(torch.int64) << (4 * i)
        assert torch.equal(t["qweight"][:, col].to(torch.int64) & 0xFFFFFFFF, word)
    c, z, s = awq_unpack(t)
    assert torch.equal(c, qw.q) and torch.equal(z, qw.zero)
    assert torch.allclose(s, qw.scale, rtol=1e-3)
