"""The model's quantization config: which method each linear layer gets, from a load-time choice
(``quantization="int8"|"int4"``) or a pre-quantized checkpoint's quantization_config."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from dabba.arch.checkpoint_names import shard_checkpoint_names
from dabba.quantization.base import LinearMethod, UnquantizedLinearMethod
from dabba.quantization.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS, CompressedTensorsConfig
from dabba.quantization.gguf import GGUFLinearMethod
from dabba.quantization.gguf_blocks import row_bytes
from dabba.quantization.gptq_format import AWQLinearMethod, GPTQLinearMethod
from dabba.quantization.rtn import Int4RTNMethod, Int8RTNMethod
from dabba.quantization.w8a8 import W8A8Method

QUANTIZATION_METHODS = ("int8", "int4", "w8a8")  # applied at load time; the rest come from a checkpoint
CHECKPOINT_METHODS = ("gptq", "awq", "gguf", COMPRESSED_TENSORS)


@dataclass(frozen=True)
class QuantConfig:
    """Round-to-nearest weight-only quantization applied at load time.

    int8: symmetric, per output channel. int4: asymmetric with an integer zero point, per group
    of ``group_size`` input channels (64 or 32 for a layer whose width the group does not tile).
    w8a8: int8's codes, times activations rounded to INT8 per token at run time (w8a8.py).
    Scale s = (r_max - r_min) / (2^bits - 1).
    """

    method: str
    group_size: int = 128
    bits: int = 4  # "gptq" checkpoints: 4 or 8
    desc_act: bool = False  # "gptq" checkpoints: act-order (g_idx not monotonic)
    # "gguf" files: each quantized tensor's GGUF type, by its checkpoint module name ("...q_proj")
    tensor_types: dict[str, str] = field(default_factory=dict, compare=False)
    compressed_tensors: CompressedTensorsConfig | None = None  # "compressed-tensors" checkpoints (W8A8)

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS + CHECKPOINT_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {self.method!r}")
        if self.group_size < 1 and not (self.method == "gptq" and self.group_size == -1):
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "QuantConfig":
        """config.json's quantization_config, as GPTQ/AWQ tools and llm-compressor write it."""
        method = qc.get("quant_method")
        if method == COMPRESSED_TENSORS:
            return cls(COMPRESSED_TENSORS, compressed_tensors=CompressedTensorsConfig.from_config(qc))
        if method == "gguf":  # written by models/gguf_checkpoint.py from the file's tensor table
            return cls("gguf", tensor_types=dict(qc["tensor_types"]))
        if method == "awq":
            if str(qc.get("version", "gemm")).lower() != "gemm" or qc.get("bits", qc.get("w_bit", 4)) != 4:
                raise ValueError(f"unsupported AWQ checkpoint (version {qc.get('version')!r}, bits "
                                 f"{qc.get('bits', qc.get('w_bit'))!r}): supported is version gemm, 4 bits")
            if not qc.get("zero_point", True):
                raise ValueError("unsupported AWQ checkpoint: zero_point false")
            return cls("awq", group_size=int(qc.get("group_size", qc.get("q_group_size", 128))), bits=4)
        if method != "gptq":
            raise ValueError(f"unsupported quantization_config quant_method {method!r} (supported: 'gptq', 'awq', "
                             f"{COMPRESSED_TENSORS!r})")
        if qc.get("checkpoint_format", "gptq") != "gptq":
            raise ValueError(f"unsupported GPTQ checkpoint_format {qc.get('checkpoint_format')!r} (supported: 'gptq')")
        if qc.get("bits") not in (4, 8):
            raise ValueError(f"unsupported GPTQ bits {qc.get('bits')!r} (supported: 4, 8)")
        return cls("gptq", group_size=int(qc.get("group_size", 128)), bits=int(qc["bits"]),
                   desc_act=bool(qc.get("desc_act", False)))

    def get_lm_head_method(self) -> LinearMethod | None:
        """Load-time int8 and int4 also quantize the LM head, to INT8 per output channel: at
        SmolLM's size it is a fifth of the weights, the largest single read of a decode step.
        (llama.cpp likewise keeps output.weight at 6 to 8 bits under Q4_0.) Load-time w8a8 makes
        it W8A8 like its other layers: a batch's logits then take the integer GEMM with weights
        packed once (INT8 weight-only re-gathers the vocabulary's codes into panels every call),
        and each row's logits are the same bits whatever rows share the step. A tied embedding
        then looks its rows up in these codes (LMHead.shares_packed_rows), so the vocabulary is
        held once. GPTQ/AWQ and compressed-tensors checkpoints leave the head as saved (a
        compressed-tensors config that quantizes it is refused)."""
        if self.method == "gguf":  # a quantized output.weight (or tied token_embd) stays in its blocks
            return GGUFLinearMethod([self.tensor_types["lm_head"]]) if "lm_head" in self.tensor_types else None
        if self.method == "w8a8":
            return W8A8Method()
        return Int8RTNMethod() if self.method in QUANTIZATION_METHODS else None

    def embedding_bytes(self, rows: int, hidden_size: int) -> int | None:
        """A GGUF file's quantized token embedding: its blocks' bytes (None: held in the model's dtype)."""
        type_name = self.tensor_types.get("model.embed_tokens") if self.method == "gguf" else None
        return None if type_name is None else rows * row_bytes(type_name, hidden_size)

    def get_linear_method(self, layer: nn.Module) -> LinearMethod:
        if self.method == COMPRESSED_TENSORS:
            return self.compressed_tensors.linear_method(layer)
        if self.method == "gguf":  # a layer the file quantized (any of its shards) reads the blocks
            fused = self.tensor_types.get(layer.prefix)  # one tensor for every shard (Phi-3's qkv_proj, gate_up_proj)
            names = shard_checkpoint_names(layer.prefix, layer.shard_ids)
            types = [fused] * len(names) if fused else [self.tensor_types.get(name) for name in names]
            if not any(types):
                return UnquantizedLinearMethod()
            return GGUFLinearMethod([t or "F32" for t in types])
        if self.method in ("gptq", "awq"):
            group_size = self.group_size if self.group_size > 0 else layer.full_in_features
            if self.method == "gptq":
                return GPTQLinearMethod(self.bits, group_size, self.desc_act)
            return AWQLinearMethod(group_size)

        if self.method == "int8":
            return Int8RTNMethod()
        if self.method == "w8a8":
            return W8A8Method()
        # Groups must tile the layer's input width (SmolLM's 576 is not a multiple of 128):
        # fall back to smaller groups, or leave the layer unquantized.
        for group_size in (self.group_size, 64, 32):  # of the whole layer's width, the same at every tensor-parallel size
            if layer.full_in_features % group_size == 0 and group_size <= self.group_size:
                return Int4RTNMethod(group_size)
        return UnquantizedLinearMethod()
