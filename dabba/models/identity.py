"""A model's identity for caches that outlive the process (the KV disk tier): equal keys mean the
same weights, tokenizer, dtype and cache layout, so a block computed by one run serves another.

Hashing every weight byte would cost a full read of the checkpoint at each start; the key hashes
each weight file's name, size and 16 pieces of 4 KiB spread over it (a fine-tune changes the
values everywhere), config.json and the tokenizer's files whole, and the options that shape the
KV (dtype, KV dtype, block size, quantization, tensor-parallel size)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from dabba.models.resolved_config import ResolvedConfig

PIECES, PIECE = 16, 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def model_key(resolved: ResolvedConfig) -> str:
    config = resolved.config
    cc = config.cache_config
    return _model_key(resolved.model_dir, resolved.tokenizer_dir, config.model_config.gguf_file,
                      repr((str(resolved.dtype), cc.kv_cache_dtype, cc.block_size, resolved.quant_config,
                            config.parallel_config.tensor_parallel_size)))


@functools.lru_cache(maxsize=8)
def _model_key(model_dir: str, tokenizer_dir: str, gguf: str | None, layout: str) -> str:
    """Once per process for each model: the engine and its worker both ask."""
    h = hashlib.sha256(b"dabba-model-key-1")
    directory = Path(model_dir)
    weights = [directory / gguf] if gguf else sorted(directory.glob("*.safetensors"))
    for path in weights:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(PIECES):
                f.seek(i * max(size - PIECE, 0) // max(PIECES - 1, 1))
                h.update(f.read(PIECE))
    for path in [directory / "config.json", *(Path(tokenizer_dir) / n for n in TOKENIZER_FILES)]:
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(layout.encode())
    return h.hexdigest()[:32]
