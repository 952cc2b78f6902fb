"""Tiny GGUF files for tests, written here with gguf-py's writer (no converter, no quantizer): a
small Llama whose linears hold random blocks (tools/random_gguf.py)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tools.random_gguf import random_blocks

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 300
# a Q4_K_M-like mix: each linear of a layer in another type (Q4_0 where rows are 512 long, so that
# the engine holds it in its Q4_0x16 layout)
LINEAR_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_1",
                "ffn_up": "Q8_0", "ffn_down": "Q4_0"}


def write_llama(path, quantized: bool = True, types: dict[str, str] = LINEAR_TYPES, embedding: str = "F32",
                head: str | None = "F32", layers: int = LAYERS) -> str:
    """A small Llama whose linears hold random GGUF blocks of ``types``, its token embedding and LM
    head of ``embedding`` and ``head`` (None: tied, no output.weight); ``quantized`` False writes
    the same weights dequantized, as F32 (the reference model). Fewer ``layers`` keep the first
    ones of the file with more (a draft model that agrees with it some of the time)."""
    w = GGUFWriter(str(path), "llama")
    for key, value in {"block_count": layers, "context_length": 256, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    tokens = ["<s>", "</s>"] + [f"t{i}" for i in range(VOCAB - 2)]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3, 3] + [1] * (VOCAB - 2))
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)

    def add(name: str, type_name: str, shape: tuple[int, int], seed: int) -> None:
        blocks = random_blocks(type_name, *shape, seed)
        if quantized and type_name != "F32":
            w.add_tensor(name, blocks.data.numpy(), raw_shape=blocks.data.shape, raw_dtype=GGMLQuantizationType[type_name])
        else:
            w.add_tensor(name, blocks.dequantize().numpy())

    add("token_embd.weight", embedding, (VOCAB, HIDDEN), 1000)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if head is not None:
        add("output.weight", head, (VOCAB, HIDDEN), 1001)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    seed = 0
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, shape in shapes.items():
            seed += 1
            add(f"blk.{i}.{name}.weight", types[name], shape, seed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
