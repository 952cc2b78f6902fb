"""A GGUF file served as a checkpoint: a directory made beside nothing (a temporary one, removed at
exit) holding the config, tokenizer and generation files its metadata maps to (arch/gguf_model.py)
and a link to the file itself, whose tensors the loader then reads by their GGUF names."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

import torch

from dabba.arch.config import ArchConfig
from dabba.arch.gguf_file import GGUFFile, GGUFTensor, read_gguf
from dabba.arch.gguf_model import generation_config, hf_config
from dabba.arch.gguf_tokenizer import tokenizer_config, tokenizer_json
from dabba.quantization.gguf import FLOAT_TYPES, GGUFBlocks
from dabba.quantization.gguf_blocks import dequantize

GGUF_LINK = "model.gguf"  # the file, in the directory made for it

# GGUF tensor names (per block: blk.N.<name>) -> the Hugging Face names dabba's families load
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE block's router
}
# where a family's blocks name them otherwise: Phi-3's fused projections, Gemma's four norms
FAMILY_BLOCK_NAMES = {
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
FAMILY_BLOCK_NAMES["gemma3"] = FAMILY_BLOCK_NAMES["gemma2"]
# Gemma's norms scale by (1 + w): llama.cpp's converter stores 1 + w, the checkpoint w
NORM_SHIFTED = ("gemma2", "gemma3")
# a MoE block's experts, stacked [experts, rows, columns]: each expert's own tensor under these names
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}
BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# read into the config (arch/gguf_model.py), not weights
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_made: list[Path] = []


def gguf_model_dir(path: str | Path) -> Path:
    """The checkpoint directory of a GGUF file (of a split one, its first shard). The path is not
    resolved: a shard in the Hugging Face cache is a link to a blob, and its name finds the others."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    f = read_gguf(path)
    config = hf_config(f)
    tokenizer = tokenizer_json(f, config["vocab_size"])
    _check(path, config, tokenizer)
    directory = Path(tempfile.mkdtemp(prefix="dabba-gguf-"))
    if not _made:
        atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _made])
    _made.append(directory)
    types = quantized_tensor_types(f, config["num_hidden_layers"])
    if types:  # the layers that read GGUF blocks (quantization/config.py)
        config["quantization_config"] = {"quant_method": "gguf", "tensor_types": types}
    files = {"config.json": config, "generation_config.json": generation_config(f),
             "tokenizer_config.json": tokenizer_config(f), "tokenizer.json": tokenizer}
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content, ensure_ascii=False))
    (directory / GGUF_LINK).symlink_to(path)
    return directory


def _check(path: Path, config: dict, tokenizer: dict) -> None:
    """What the file's metadata maps to, checked here so that its errors name the file, not the
    directory made for it: the config as dabba reads config.json, the tokenizer as tokenizers
    builds it (a merge of tokens the vocabulary lacks, say)."""
    from tokenizers import Tokenizer

    try:
        ArchConfig.from_dict(config)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: its metadata does not describe a model dabba can build ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        Tokenizer.from_str(json.dumps(tokenizer))
    except Exception as e:  # tokenizers raises its own Exception
        raise ValueError(f"{path}: tokenizer.ggml.* do not make a tokenizer ({e})") from None


def _unpermute(w: torch.Tensor | GGUFBlocks, n_head: int) -> torch.Tensor | GGUFBlocks:
    """llama.cpp's converter interleaves each Llama head's rotary halves (its LlamaModel.permute);
    this puts them back as transformers has them (rows of blocks move as the rows they hold)."""
    if isinstance(w, GGUFBlocks):
        return GGUFBlocks(w.type_name, _unpermute(w.data, n_head), w.columns)
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read(file: BinaryIO, tensor: GGUFTensor, part: int = 0, parts: int = 1) -> torch.Tensor:
    """Part ``part`` of ``parts`` equal parts of a tensor's bytes (an expert's of a stacked tensor),
    read into memory of this process's own: through the file's map, every page copied would stay
    mapped, and counted in the process's memory, until the whole file is read (a Q8_0 model's peak
    was the file plus its copy)."""
    nbytes = tensor.data.nbytes // parts
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    file.seek(tensor.offset + part * nbytes)
    if file.readinto(buffer.numpy()) != nbytes:
        raise ValueError(f"{file.name}: tensor {tensor.name!r} ends early: truncated while being read?")
    return buffer


def _hf_tensors(f: GGUFFile, num_layers: int) -> Iterator[tuple[str, GGUFTensor, int | None]]:
    """Each tensor under its Hugging Face name, with the expert it holds where a stacked MoE
    tensor [experts, rows, columns] holds one per expert (the same tensor once per expert)."""
    block_names = BLOCK_NAMES | FAMILY_BLOCK_NAMES.get(f.get("general.architecture"), {})
    for name, tensor in f.tensors.items():
        if name in CONFIG_TENSORS:
            continue
        hf = GLOBAL_NAMES.get(name)
        match = BLOCK.fullmatch(name)
        known = match is not None and int(match.group(1)) < num_layers
        if hf is None and known and match.group(2) in EXPERT_NAMES and len(tensor.shape) == 3:
            for e in range(tensor.shape[0]):
                yield f"model.layers.{match.group(1)}.mlp.experts.{e}.{EXPERT_NAMES[match.group(2)]}.weight", tensor, e
            continue
        if hf is None:
            if not known or match.group(2) not in block_names:
                raise ValueError(f"{f.path}: the GGUF file holds a tensor dabba does not know: {name!r}")
            hf = f"model.layers.{match.group(1)}.{block_names[match.group(2)]}"
        yield hf, tensor, None


def quantized_tensor_types(f: GGUFFile, num_layers: int) -> dict[str, str]:
    """The matrices the file quantizes, by checkpoint module name -> GGUF type: these stay in their
    blocks (quantization/gguf.py), the embedding and the LM head too. A tied head (no output.weight)
    reads token_embd's blocks, and is listed with its type."""
    types = {hf.removesuffix(".weight"): tensor.type_name for hf, tensor, _ in _hf_tensors(f, num_layers)
             if tensor.type_name not in FLOAT_TYPES and hf.endswith(".weight") and len(tensor.shape) >= 2}
    embedding = GLOBAL_NAMES["token_embd.weight"].removesuffix(".weight")
    if "output.weight" not in f.tensors and embedding in types:
        types[GLOBAL_NAMES["output.weight"].removesuffix(".weight")] = types[embedding]
    return types


def _blocks(file: BinaryIO, tensor: GGUFTensor, expert: int | None) -> GGUFBlocks:
    """The tensor's (or one expert's) rows of blocks."""
    parts = tensor.shape[0] if expert is not None else 1
    data = _read(file, tensor, expert or 0, parts).view(tensor.shape[-2], -1)
    return GGUFBlocks(tensor.type_name, data, tensor.shape[-1])


def iterate_gguf_weights(path: Path, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Every tensor under its Hugging Face name: a quantized matrix as its blocks (GGUFBlocks),
    anything else as float32; read from the file, not through its map (_read)."""
    if path.is_symlink():  # the directory's link: the file as given, so that errors name it (and its shards)
        path = Path(os.path.abspath(path.parent / os.readlink(path)))
    f: GGUFFile = read_gguf(path)
    family = f.get("general.architecture")
    llama = family == "llama"  # the converter interleaved its q and k (Mixtral's too)
    quantized = quantized_tensor_types(f, arch.num_hidden_layers)
    dense_experts: dict[str, torch.Tensor] = {}  # a stacked float tensor, dequantized once for all its experts
    with contextlib.ExitStack() as stack:
        files: dict[Path, BinaryIO] = {}  # each shard's, opened once
        for hf, tensor, expert in _hf_tensors(f, arch.num_hidden_layers):
            if tensor.file not in files:
                files[tensor.file] = stack.enter_context(open(tensor.file, "rb"))
            file = files[tensor.file]
            if hf.removesuffix(".weight") in quantized:
                value = _blocks(file, tensor, expert)
            elif expert is not None:
                if expert == 0:
                    dense_experts[tensor.name] = dequantize(tensor.type_name, _read(file, tensor), tensor.shape)
                value = dense_experts[tensor.name][expert]
                if expert == tensor.shape[0] - 1:
                    del dense_experts[tensor.name]
            else:
                value = dequantize(tensor.type_name, _read(file, tensor), tensor.shape)
                if family in NORM_SHIFTED and hf.endswith("norm.weight"):
                    value -= 1.0
            yield hf, _unpermuted(value, hf, arch) if llama else value


def _unpermuted(value: torch.Tensor | GGUFBlocks, hf: str, arch: ArchConfig) -> torch.Tensor | GGUFBlocks:
    if hf.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(value, arch.num_attention_heads)
    if hf.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(value, arch.num_key_value_heads)
    return value
