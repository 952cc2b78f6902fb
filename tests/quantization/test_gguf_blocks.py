"""GGUF's block types dequantized in PyTorch (dabba/quantization/gguf_blocks.py) equal llama.cpp's
gguf-py, bit for bit, on random blocks and on blocks of edge values (zero, negative zero, the
largest, subnormal, infinite and NaN scales; all-zero and all-one quants)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from dabba.quantization.gguf_blocks import BLOCKS, dequantize

BLOCK_TYPES = [t for t, (block, _) in BLOCKS.items() if block > 1]
F16_FIELDS = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}  # where the scales sit
EDGE_F16 = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, 1.0, -1.0, np.inf, -np.inf, np.nan], dtype=np.float16)


def assert_same_bits(ours: torch.Tensor, theirs: np.ndarray) -> None:
    theirs = np.ascontiguousarray(theirs, dtype=np.float32)
    ours_np = ours.numpy()
    assert ours_np.shape == theirs.shape
    nan = np.isnan(theirs)
    assert (np.isnan(ours_np) == nan).all()
    assert (ours_np.view(np.uint32)[~nan] == theirs.view(np.uint32)[~nan]).all()


def edge_blocks(type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks whose every float16 field takes each edge value, with quants all 0, all 1 bits, random."""
    block, size = BLOCKS[type_name]
    rows = []
    for fill in (0x00, 0xFF, None):
        for value in EDGE_F16:
            b = np.full(size, fill, np.uint8) if fill is not None else rng.integers(0, 256, size, dtype=np.uint8)
            f16 = np.frombuffer(value.tobytes(), np.uint8)
            for p in F16_FIELDS.get(type_name, [0]):
                b[p:p + 2] = f16
            rows.append(b)
    return np.stack(rows)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_random_and_edge_blocks_dequantize_as_gguf_py_does(type_name) -> None:
    rng = np.random.default_rng(sum(map(ord, type_name)))
    block, size = BLOCKS[type_name]
    qtype = GGMLQuantizationType[type_name]
    for raw in (rng.integers(0, 256, (64, 4 * size), dtype=np.uint8), edge_blocks(type_name, rng)):
        with np.errstate(all="ignore"):
            theirs = quants.dequantize(raw, qtype)
        ours = dequantize(type_name, torch.from_numpy(raw.copy()), theirs.shape)
        assert_same_bits(ours, theirs)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_values_quantized_by_gguf_py_come_back_the_same(type_name) -> None:
    """gguf-py quantizes these types too: real weights, not only random bytes."""
    weights = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType[type_name])
    assert_same_bits(dequantize(type_name, torch.from_numpy(raw), weights.shape),
                     quants.dequantize(raw, GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name, dtype", [("F32", np.float32), ("F16", np.float16)])
def test_float_types(type_name, dtype) -> None:
    values = np.random.default_rng(1).standard_normal((3, 64)).astype(dtype)
    raw = torch.from_numpy(values.view(np.uint8).copy())
    assert_same_bits(dequantize(type_name, raw, values.shape), values.astype(np.float32))


def test_bf16() -> None:
    raw = np.random.default_rng(2).integers(0, 256, (4, 128), dtype=np.uint8)
    assert_same_bits(dequantize("BF16", torch.from_numpy(raw.copy()), (4, 64)),
                     quants.dequantize(raw, GGMLQuantizationType.BF16))
