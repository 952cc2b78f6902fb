"""Make the GGUF files the llama.cpp peer runs (and dabba's GGUF tests read): bf16 (or f32, f16),
then Q8_0 / Q4_0 quantized from it.

    python benchmarks/peers/make_gguf.py --model HF_DIR --llama-cpp-dir DIR --out-dir OUT \
        [--types bf16,q8_0,q4_0] [--convert-python PY]

Run it with the llama.cpp venv's Python. Writes OUT/model-{type}.gguf and prints one JSON dict
{type: path} on stdout (logs go to stderr). Files that already exist are kept.

- bf16, f32, f16: llama.cpp's own convert_hf_to_gguf.py (from the llama.cpp source tree DIR, with its
  gguf-py), run in-process so that one thing can be patched without editing the tree: a BPE
  pre-tokenizer whose hash llama.cpp does not know (the test checkpoints' tokenizer is trained
  locally) is written as "gpt-2" instead of aborting the conversion.
- q8_0, q4_0, q4_k_m, q5_k_m, q6_k: llama_cpp.llama_model_quantize on the bf16 file, llama.cpp's
  default quantize parameters with that ftype (what `llama-quantize in out Q4_K_M` does).

The converter imports torch and transformers. When this interpreter has them not (the llama.cpp
venv has neither), give --convert-python: a Python that has them; this
script then runs itself under that Python for the bf16 step only (it needs sentencepiece too).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

log = logging.getLogger("make_gguf")

QUANT_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
                "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
                "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
CONVERTED_TYPES = ("bf16", "f32", "f16")  # written by the converter itself
ALL_TYPES = (*CONVERTED_TYPES, *QUANT_FTYPES)


def gguf_path(out_dir: Path, gguf_type: str, shards: int = 1) -> Path:
    """The file (of a split one, its first shard, llama.cpp's naming)."""
    return out_dir / (f"model-{gguf_type}.gguf" if shards == 1 else f"model-{gguf_type}-00001-of-{shards:05d}.gguf")


def can_convert_here() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def patch_unknown_pre_tokenizer() -> None:
    """Make TextModel.get_vocab_base_pre return "gpt-2" where it would raise on an unknown hash."""
    from conversion.base import TextModel, logger

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            logger.warning("unrecognised BPE pre-tokenizer: writing tokenizer.ggml.pre = 'gpt-2'")
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre


@contextlib.contextmanager
def padded_vocabulary(model_dir: Path) -> Iterator[Path]:
    """``model_dir``, or a view of it whose tokenizer.json lists config.json's whole vocab_size.

    A shaped random checkpoint pairs a large embedding with the small tokenizer dabba trains; the
    converter's Gemma 3 trims the embedding to the tokenizer's length, and llama.cpp then refuses
    the file. Padding the tokenizer with unused special tokens (as Gemma's own tokenizer holds
    thousands) keeps every row."""
    vocab_size = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    tokenizer_path = model_dir / "tokenizer.json"
    tok = json.loads(tokenizer_path.read_text()) if tokenizer_path.is_file() else None
    have = len(tok["model"]["vocab"]) + len(tok["added_tokens"]) if tok else None
    if tok is None or vocab_size is None or have >= vocab_size:
        yield model_dir
        return
    with tempfile.TemporaryDirectory() as tmp:
        view = Path(tmp)
        for f in model_dir.iterdir():
            if f.name != "tokenizer.json":
                (view / f.name).symlink_to(f.resolve())
        tok["added_tokens"] += [{"id": i, "content": f"<unused{i}>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True}
                                for i in range(have, vocab_size)]
        (view / "tokenizer.json").write_text(json.dumps(tok))
        log.info("padded the tokenizer from %d to vocab_size %d tokens for the converter", have, vocab_size)
        yield view


def convert_in_process(model_dir: Path, llama_cpp_dir: Path, out: Path, outtype: str = "bf16",
                       split_max_tensors: int = 0) -> None:
    """convert_hf_to_gguf.py MODEL --outfile OUT --outtype OUTTYPE [--split-max-tensors N], in this
    interpreter. Split, OUT's shards are named as the converter names them (OUT-0000k-of-0000n)."""
    # The tree's own gguf-py first: the converter expects the gguf package of its own revision.
    sys.path[:0] = [str(llama_cpp_dir / "gguf-py"), str(llama_cpp_dir)]
    patch_unknown_pre_tokenizer()
    import convert_hf_to_gguf

    argv = sys.argv
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        try:
            with padded_vocabulary(model_dir) as source, contextlib.redirect_stdout(sys.stderr):
                # stdout carries only this script's JSON
                sys.argv = ["convert_hf_to_gguf.py", str(source), "--outfile", str(Path(tmp) / out.name),
                            "--outtype", outtype]
                if split_max_tensors:
                    sys.argv += ["--split-max-tensors", str(split_max_tensors)]
                convert_hf_to_gguf.main()
        finally:
            sys.argv = argv
        for made in sorted(Path(tmp).iterdir()):
            os.replace(made, out.parent / made.name)


def convert_with(python: str, model_dir: Path, llama_cpp_dir: Path, out_dir: Path, outtype: str,
                 split_max_tensors: int = 0) -> None:
    """Run this script under another Python (one with torch + transformers) for a converted file."""
    cmd = [python, os.path.abspath(__file__), "--model", str(model_dir), "--llama-cpp-dir", str(llama_cpp_dir),
           "--out-dir", str(out_dir), "--types", outtype, "--split-max-tensors", str(split_max_tensors)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def make_converted(model_dir: Path, llama_cpp_dir: Path, out_dir: Path, convert_python: str | None,
                   outtype: str = "bf16", split_max_tensors: int = 0) -> Path:
    if split_max_tensors:  # the converter's shards: as many as its tensors take
        out = next(iter(sorted(out_dir.glob(f"model-{outtype}-00001-of-*.gguf"))), gguf_path(out_dir, outtype, 2))
    else:
        out = gguf_path(out_dir, outtype)
    if out.exists():
        log.info("exists: %s", out)
    elif convert_python is None:
        if not can_convert_here():
            sys.exit(f"{sys.executable} lacks torch/transformers, which convert_hf_to_gguf.py imports: "
                     "pass --convert-python PY (a Python that has them)")
        convert_in_process(model_dir, llama_cpp_dir, gguf_path(out_dir, outtype), outtype, split_max_tensors)
    else:
        convert_with(convert_python, model_dir, llama_cpp_dir, out_dir, outtype, split_max_tensors)
    if split_max_tensors:
        return sorted(out_dir.glob(f"model-{outtype}-00001-of-*.gguf"))[0]
    return out


def quantize(src: Path, out: Path, gguf_type: str, nthread: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[gguf_type])
    params.nthread = nthread
    tmp = out.with_name(out.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize {src} -> {tmp} ({gguf_type}) returned {rc}")
    os.replace(tmp, out)


def parse_types(text: str) -> list[str]:
    types = [t.strip().lower() for t in text.split(",") if t.strip()]
    unknown = sorted(set(types) - set(ALL_TYPES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown types {unknown}; known: {','.join(ALL_TYPES)}")
    return types


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="HF checkpoint directory")
    parser.add_argument("--llama-cpp-dir", type=Path, required=True,
                        help="llama.cpp source tree (has convert_hf_to_gguf.py, conversion/, gguf-py/)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--types", type=parse_types, default=["bf16", *QUANT_FTYPES],
                        help=f"comma list of {','.join(ALL_TYPES)} (default: bf16,q8_0,q4_0)")
    parser.add_argument("--convert-python", help="Python with torch + transformers for the bf16 conversion "
                        "(default: this one)")
    parser.add_argument("--nthread", type=int, default=2, help="quantization threads")
    parser.add_argument("--split-max-tensors", type=int, default=0,
                        help="the converted types split in shards of at most N tensors (the first shard's path is "
                        "printed); the quantized types are made from an unsplit bf16 file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")

    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {t: str(make_converted(args.model.resolve(), args.llama_cpp_dir.resolve(), out_dir, args.convert_python, t,
                                   args.split_max_tensors))
             for t in args.types if t in CONVERTED_TYPES}
    quantized = [t for t in args.types if t in QUANT_FTYPES]
    bf16 = make_converted(args.model.resolve(), args.llama_cpp_dir.resolve(), out_dir, args.convert_python) \
        if quantized else None
    for gguf_type in quantized:
        out = gguf_path(out_dir, gguf_type)
        if out.exists():
            log.info("exists: %s", out)
        else:
            log.info("quantizing %s -> %s", bf16.name, out.name)
            quantize(bf16, out, gguf_type, args.nthread)
        paths[gguf_type] = str(out)
    print(json.dumps({t: paths[t] for t in args.types}))


if __name__ == "__main__":
    main()
