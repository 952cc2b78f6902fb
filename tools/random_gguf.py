"""GGUF blocks of random codes with finite scales, of a weight's size: for tests that write GGUF
files without a quantizer (tests/gguf_writer.py) and for the GGUF kernel benchmark
(benchmarks/gguf_kernels.py); and dabba's layouts of them (quantization/gguf_repack.py)."""
from __future__ import annotations

import numpy as np
import torch

from dabba.quantization.gguf import GGUFBlocks
from dabba.quantization.gguf_blocks import BLOCKS
from dabba.quantization.gguf_repack import LAYOUTS, repack

F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}  # where each block's float16 scales sit
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# a scale that gives random codes values of about 0.05, a weight's size (codes' spread times the
# sub-blocks' scales' for the K types)
BLOCK_SCALES = {"Q8_0": 0.05 / 73, "Q4_0": 0.05 / 4.6, "Q4_1": 0.05 / 4.6, "Q5_0": 0.05 / 9.2, "Q5_1": 0.05 / 9.2,
                "Q4_K": 0.05 / (36 * 4.6), "Q5_K": 0.05 / (36 * 9.2), "Q6_K": 0.05 / (73 * 18)}


def random_blocks(type_name: str, rows: int, columns: int, seed: int) -> GGUFBlocks:
    """Random codes with finite scales, of a weight's size (values of about 0.05). The bytes are
    numpy's (which puts large arrays on huge pages, as the engine puts its blobs)."""
    if type_name in LAYOUTS:  # one of dabba's layouts: the file type's random blocks, repacked
        blocks = random_blocks(LAYOUTS[type_name].file_type, rows, columns, seed)
        return GGUFBlocks(type_name, repack(type_name, blocks.data, columns), columns)
    rng = np.random.default_rng(seed)
    if type_name in FLOAT_DTYPES:
        values = torch.from_numpy(rng.standard_normal((rows, columns)).astype(np.float32) * 0.05)
        return GGUFBlocks(type_name, values.to(FLOAT_DTYPES[type_name]).view(torch.uint8).view(rows, -1), columns)
    block, size = BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    scale = BLOCK_SCALES[type_name]
    for p in F16_FIELDS[type_name]:
        d = (rng.uniform(0.5, 1.5, raw.shape[:2]) * scale * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
        raw[:, :, p:p + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return GGUFBlocks(type_name, torch.from_numpy(raw.reshape(rows, -1)), columns)
