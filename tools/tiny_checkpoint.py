"""Write tiny random-weight Hugging Face checkpoints (and a small trained BPE tokenizer, byte-level
or SentencePiece).

No downloads: the tokenizer is trained on the docstrings of Python's standard library, the
weights are random through `transformers` configs. Used by the tests and by the README's main
job until the bundled demo model exists. Needs the dev extra (transformers; sentencepiece for a
SentencePiece tokenizer).

    python -m tools.tiny_checkpoint OUT_DIR [--arch LlamaForCausalLM] [--sentencepiece llama|gemma]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import io
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


def training_corpus(own_only: bool = False) -> list[str]:
    """The docstrings of STDLIB_MODULES and their attributes. ``own_only``: only those of the
    classes and functions each module defines, not what it imports, nor a submodule or a hook that
    a test runner put there (pytest's threading.excepthook): the same corpus in every process."""
    texts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for attr in sorted(dir(module)):
            value = getattr(module, attr, None)
            doc = getattr(value, "__doc__", None)
            if isinstance(doc, str) and (not own_only or _defined_in(value, name)):
                texts.append(doc)
    return texts


def _defined_in(value: Any, module: str) -> bool:
    owner = getattr(value, "__module__", None)
    return (inspect.isclass(value) or inspect.isroutine(value)) and isinstance(owner, str) and \
        (owner == module or owner.startswith(module + "."))


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


def tokenizer_with_specials(special_tokens: tuple[str, ...], vocab_size: int = 1024, corpus: str = "docstrings"):
    """A copy of train_tokenizer's (which is cached and shared: never change it) with
    ``special_tokens`` added after its vocabulary."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(train_tokenizer(vocab_size, corpus).to_str())
    tok.add_special_tokens(list(special_tokens))
    return tok


# SentencePiece models as Llama 2's is laid out: <unk> <s> </s>, then a control and a user-defined piece
SPM_CONTROL, SPM_USER_DEFINED = ("<pad>",), ("<sep>",)
# style -> whether the model prepends a space to the text (Llama 2, Mistral, Phi-3) or not (Gemma)
SENTENCEPIECE_STYLES = {"llama": True, "gemma": False}


@functools.lru_cache(maxsize=None)
def _sentencepiece_model(vocab_size: int, add_dummy_prefix: bool) -> bytes:
    import sentencepiece as spm

    lines = [line for doc in training_corpus(own_only=True) for line in doc.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, character_coverage=0.9995,
        control_symbols=list(SPM_CONTROL), user_defined_symbols=list(SPM_USER_DEFINED), num_threads=1,
        minloglevel=2)
    return model.getvalue()


def train_sentencepiece(path: str | Path, vocab_size: int = 1000, add_dummy_prefix: bool = True) -> Path:
    """Write a SentencePiece BPE tokenizer.model as Llama 2's is made (byte fallback, no
    normalization, digits split; Gemma's: no dummy prefix) trained on the docstrings, in a
    fraction of a second. The text outside them (CJK, emoji) falls back to byte pieces."""
    path = Path(path)
    path.write_bytes(_sentencepiece_model(vocab_size, add_dummy_prefix))
    return path


def save_sentencepiece_tokenizer(out_dir: Path, style: str, vocab_size: int) -> int:
    """tokenizer.model and the transformers tokenizer made from it (a LlamaTokenizer; Gemma's
    style without the prefix space), as llama.cpp's converter reads them; their vocabulary size.

    transformers 5 writes neither tokenizer.model nor tokenizer_config.json's added_tokens_decoder,
    which the converter reads for the user-defined and control pieces (transformers 4 wrote
    both): they are written here."""
    from transformers import LlamaTokenizer

    train_sentencepiece(out_dir / "tokenizer.model", vocab_size, SENTENCEPIECE_STYLES[style])
    prefix = None if SENTENCEPIECE_STYLES[style] else False  # None: the converter writes no add_space_prefix
    tok = LlamaTokenizer.from_pretrained(out_dir, add_prefix_space=prefix, add_bos_token=True,
                                         pad_token=SPM_CONTROL[0], legacy=False)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {str(i): {**t.__getstate__(), "content": t.content}
                                      for i, t in tok.added_tokens_decoder.items()}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return len(tok.get_vocab())


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


def save_byte_level_tokenizer(out_dir: Path, vocab_size: int, corpus: str) -> int:
    """The byte-level BPE tokenizer (train_tokenizer) with <s> </s> <pad>; its vocabulary size."""
    import transformers

    tok = train_tokenizer(vocab_size, corpus)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return tok.get_vocab_size()


def make_checkpoint(out_dir: str | Path, arch: str = "LlamaForCausalLM", seed: int = 0,
                    max_shard_size: str | None = None, dtype: str = "float32", norm_std: float | None = None,
                    tokenizer_vocab_size: int = 1024, tokenizer_corpus: str = "docstrings",
                    sentencepiece: str | None = None, **overrides: Any) -> Path:
    """Save a random-weight model of ``arch`` with a trained tokenizer into ``out_dir``.

    ``sentencepiece``: "llama" or "gemma" (SENTENCEPIECE_STYLES) saves a SentencePiece tokenizer
    instead of the byte-level one (save_sentencepiece_tokenizer); its special ids are Llama 2's.

    ``norm_std``: add N(0, norm_std) noise to every RMSNorm weight, which transformers initialises
    to the identity (ones; Gemma's (1 + w) zeros), so that a norm loaded into the wrong place or
    applied the wrong way changes the output."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if sentencepiece is None:
        vocab_size = save_byte_level_tokenizer(out_dir, tokenizer_vocab_size, tokenizer_corpus)
        special_ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    else:
        vocab_size = save_sentencepiece_tokenizer(out_dir, sentencepiece, tokenizer_vocab_size)
        special_ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)

    params: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        tie_word_embeddings=False, **special_ids,
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


def scripted_checkpoint(out_dir: str | Path, pieces: list[str], also: tuple[str, ...] = (),
                        specials: tuple[str, ...] = (), bos: str | None = None, eos: str | None = None,
                        **options: Any) -> Path:
    """A tiny Llama that, whatever the prompt, replies with ``pieces`` (each added to the tokenizer
    as one token) and then its EOS: a random-weight model that thinks, calls tools or answers on
    cue, for tests of what reads its replies (reasoning and tool-call parsers, the APIs' events).

    Every layer's output projections are zero, so the last hidden state is the token's embedding
    and the next token depends on the current one only: the embeddings of the pieces are
    orthonormal, every other token shares one more unit vector, and the LM head maps each to the
    next piece (any other token to the first). ``also``: more tokens for the vocabulary, never
    written (a thinking tag the reply might open). ``specials``: tokens added as special tokens, as
    a model family's tokenizer has them (its turn markers; a piece may be one); ``bos``/``eos``:
    the tokenizer's BOS and EOS in place of <s> and </s> (the EOS ends the reply: a family's
    end-of-turn token). ``options`` go to make_checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    if len(set(pieces)) != len(pieces) or not pieces:
        raise ValueError("scripted_checkpoint: the pieces must be distinct (each token has one successor)")
    out_dir = make_checkpoint(out_dir, **options)
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in specials])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in [*pieces, *also] if p not in specials])
    tok.save(str(out_dir / "tokenizer.json"))
    ids = [tok.token_to_id(p) for p in pieces]
    config = json.loads((out_dir / "config.json").read_text())
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    for key, token in (("bos", bos), ("eos", eos)):
        if token is not None:
            if token not in specials:
                raise ValueError(f"scripted_checkpoint: the {key} token {token!r} must be among the specials")
            config[f"{key}_token_id"], tokenizer_config[f"{key}_token"] = tok.token_to_id(token), token
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = json.loads((out_dir / "generation_config.json").read_text())
    generation.update({k: config[k] for k in ("bos_token_id", "eos_token_id")})
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    hidden, old_vocab, vocab = config["hidden_size"], config["vocab_size"], tok.get_vocab_size()
    if len(pieces) + 1 > hidden:
        raise ValueError(f"scripted_checkpoint: at most {hidden - 1} pieces")
    basis = torch.linalg.qr(torch.randn(hidden, len(pieces) + 1, generator=torch.Generator().manual_seed(0)))[0].T
    other, own = basis[0], basis[1:]
    tensors = load_file(out_dir / "model.safetensors")
    dtype = tensors["model.embed_tokens.weight"].dtype
    embed = other.repeat(vocab, 1)
    embed[ids] = own
    head = torch.zeros(vocab, hidden)
    following = ids[1:] + [config["eos_token_id"]]
    head[ids[0]] = other
    for vector, successor in zip(own, following):
        head[successor] = vector
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = embed.to(dtype), (head * 8).to(dtype)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(tensors[name])
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config["vocab_size"] = vocab
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    assert vocab > old_vocab
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="LlamaForCausalLM", choices=sorted(ARCH_CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sentencepiece", choices=sorted(SENTENCEPIECE_STYLES),
                        help="a SentencePiece tokenizer in this style instead of the byte-level one")
    args = parser.parse_args()
    print(make_checkpoint(args.out_dir, args.arch, dtype=args.dtype, sentencepiece=args.sentencepiece))


if __name__ == "__main__":
    main()
