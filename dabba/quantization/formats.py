"""The packed INT4/INT8 layouts other tools write, to save and load them bit for bit.

GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"), for a linear of [out, in]:
    qweight  int32 [in * bits / 32, out]   32/bits codes of consecutive input rows per int32, low bits first
    qzeros   int32 [groups, out * bits / 32] zero points packed the same way along outputs, stored minus 1
                                           (so a zero point of 0 cannot be stored: writers use symmetric codes)
    scales   fp16  [groups, out]
    g_idx    int32 [in]                    group of each input row
    w[i, j] = scales[g_idx[i], j] * (q[i, j] - (qzeros[g_idx[i], j] + 1))

AWQ "gemm" (AutoAWQ), 4 bits:
    qweight  int32 [in, out / 8]   8 codes of consecutive outputs per int32, in the order 0 2 4 6 1 3 5 7
    qzeros   int32 [groups, out / 8] the same packing, stored as is
    scales   fp16  [groups, out]
    w[i, j] = scales[i // group_size, j] * (q[i, j] - z[i // group_size, j])
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an int32 holds output 8n + AWQ_ORDER[k]


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] codes in [0, 2^bits) -> int32 [rows * bits / 32, cols]: row r lands in
    word r // per_word at bit offset (r % per_word) * bits."""
    per_word = 32 // bits
    rows, cols = codes.shape
    if rows % per_word:
        raise ValueError(f"{rows} rows do not pack into {per_word}-code words")
    c = codes.to(torch.int64).view(rows // per_word, per_word, cols)
    shifts = (torch.arange(per_word, dtype=torch.int64) * bits)[None, :, None]
    packed = (c << shifts).sum(dim=1)  # < 2^32
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # as two's-complement int32


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_word = 32 // bits
    words, cols = packed.shape
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per_word, dtype=torch.int64) * bits)[None, :, None]
    return ((p[:, None, :] >> shifts) & (2**bits - 1)).reshape(words * per_word, cols).to(torch.int32)


def gptq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int) -> dict[str, torch.Tensor]:
    """codes [out, in], zeros/scales [out, groups] (dabba's orientation) -> the GPTQ tensors."""
    if (zeros == 0).any():
        raise ValueError('the "gptq" format stores zero - 1 and cannot hold a zero point of 0 (use symmetric codes)')
    return {
        "qweight": pack_rows(codes.T.contiguous(), bits),
        "qzeros": pack_rows(zeros - 1, bits).T.contiguous(),  # packed along outputs
        "scales": scales.T.contiguous().to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def gptq_unpack(t: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ tensors -> codes [out, in], zeros [out, groups] (the stored value + 1), scales, g_idx."""
    codes = unpack_rows(t["qweight"], bits).T.contiguous()
    zeros = unpack_rows(t["qzeros"].T.contiguous(), bits) + 1
    return codes, zeros, t["scales"].T.float().contiguous(), t["g_idx"]


def awq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """codes [out, in], zeros/scales [out, groups] -> AWQ gemm tensors (4 bits)."""
    def pack_cols(x: torch.Tensor) -> torch.Tensor:  # x [rows, out] -> [rows, out / 8]
        rows, out = x.shape
        reordered = x.view(rows, out // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble k <- output AWQ_ORDER[k]
        return pack_rows(reordered.permute(2, 0, 1).reshape(8, -1), 4).view(rows, out // 8)

    return {"qweight": pack_cols(codes.T.contiguous()), "qzeros": pack_cols(zeros.T.contiguous()),
            "scales": scales.T.contiguous().to(torch.float16)}


def awq_unpack(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def unpack_cols(p: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out]
        rows, words = p.shape
        nibbles = unpack_rows(p.reshape(1, -1), 4).view(8, rows, words)  # nibble k of every word
        out = torch.empty(rows, words, 8, dtype=torch.int32)
        out[:, :, list(AWQ_ORDER)] = nibbles.permute(1, 2, 0)
        return out.view(rows, words * 8)

    return unpack_cols(t["qweight"]).T.contiguous(), unpack_cols(t["qzeros"]).T.contiguous(), t["scales"].T.float().contiguous()
