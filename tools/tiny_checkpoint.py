"""Write tiny random-weight Hugging Face checkpoints (and a small trained BPE tokenizer).

No downloads: the tokenizer is trained on the docstrings of Python's standard library, the
weights are random through `transformers` configs. Used by the tests and by the README's main
job until the bundled demo model exists. Needs the dev extra (transformers).

    python -m tools.tiny_checkpoint OUT_DIR [--arch LlamaForCausalLM]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
import sysconfig
from pathlib import Path
from typing import Any, Iterator

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
STDLIB_MODULES = ("json", "os", "re", "collections", "functools", "itertools", "pathlib", "argparse", "logging",
                  "dataclasses", "subprocess", "threading", "asyncio", "random", "string", "textwrap")


def training_corpus() -> list[str]:
    texts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return texts


def stdlib_sources() -> Iterator[str]:
    """The Python standard library's source (about 30 MB): enough text for a vocabulary of a real
    model's size, which the docstrings above are not."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "test" not in path.parts and "site-packages" not in path.parts:
            yield path.read_text(errors="replace")


@functools.lru_cache(maxsize=None)
def train_tokenizer(vocab_size: int = 1024, corpus: str = "docstrings"):
    """Byte-level BPE with <s>/</s> specials; BOS is prepended by the post-processor, as Llama's is.
    ``corpus``: "docstrings" (fast, a few thousand tokens at most) or "stdlib" (the source: a full
    vocabulary of tens of thousands of tokens, in about a minute)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(training_corpus() if corpus == "docstrings" else stdlib_sources(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    return tok


ARCH_CONFIGS = {
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "OlmoeForCausalLM": "OlmoeConfig",
    "Phi3ForCausalLM": "Phi3Config",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
}


def make_checkpoint(out_dir: str | Path, arch: str = "LlamaForCausalLM", seed: int = 0,
                    max_shard_size: str | None = None, dtype: str = "float32", norm_std: float | None = None,
                    tokenizer_vocab_size: int = 1024, tokenizer_corpus: str = "docstrings", **overrides: Any) -> Path:
    """Save a random-weight model of ``arch`` with a trained tokenizer into ``out_dir``.

    ``norm_std``: add N(0, norm_std) noise to every RMSNorm weight, which transformers initialises
    to the identity (ones; Gemma's (1 + w) zeros), so that a norm loaded into the wrong place or
    applied the wrong way changes the output."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(tokenizer_vocab_size, tokenizer_corpus)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)

    params: dict[str, Any] = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )
    params.update(overrides)
    config = getattr(transformers, ARCH_CONFIGS[arch])(**params)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if norm_std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * norm_std)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def first_layers(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """A copy of checkpoint ``src`` (one safetensors file) keeping only its first ``num_layers``
    decoder layers: a draft model for speculative decoding that agrees with its target often, not
    always (a random-weight draft of its own would hardly ever agree)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    layer = re.compile(r"\.layers\.(\d+)\.")
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not ((m := layer.search(k)) and int(m.group(1)) >= num_layers)},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="LlamaForCausalLM", choices=sorted(ARCH_CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(make_checkpoint(args.out_dir, args.arch, dtype=args.dtype))


if __name__ == "__main__":
    main()
