"""The GGUF reader (dabba/arch/gguf_file.py): a file written by gguf-py's own writer reads back
whole; every way a stranger's file can be wrong is one ValueError naming the file, and a few
thousand mutated headers give either a file or that error, never another exception or a hang."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants

from dabba.arch.gguf_file import read_gguf


def write(path, tensors=None, extra=None) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_block_count(2)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    for name, kind in (tensors or {"f32": "F32", "f16": "F16", "q8": "Q8_0", "q4k": "Q4_K"}).items():
        if kind == "F32":
            w.add_tensor(name, weights)
        elif kind == "F16":
            w.add_tensor(name, weights.astype(np.float16))
        elif kind == "Q8_0":
            w.add_tensor(name, quants.quantize(weights, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:  # raw blocks of a type gguf-py does not quantize
            qtype = GGMLQuantizationType[kind]
            block, size = quants.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (4, 256 // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)  # its shape in bytes: (4, 256) values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.gguf"
    write(path)
    return path


def test_a_file_reads_back_whole(good) -> None:
    f = read_gguf(good)
    assert f.get("general.architecture") == "llama" and f.require("llama.context_length") == 64
    assert f.get("tokenizer.ggml.tokens") == ["a", "b", "<s>"] and f.get("tokenizer.ggml.scores") == [0.0, -1.0, -2.0]
    assert {n: (t.type_name, t.shape) for n, t in f.tensors.items()} == {
        "f32": ("F32", (4, 64)), "f16": ("F16", (4, 64)), "q8": ("Q8_0", (4, 64)), "q4k": ("Q4_K", (4, 256))}
    assert f.tensors["q8"].data.nbytes == 4 * 2 * 34 and f.tensors["q4k"].data.nbytes == 4 * 144
    with pytest.raises(ValueError, match="lacks the metadata key 'llama.rope.freq_base'"):
        f.require("llama.rope.freq_base")


def test_an_unsupported_type_is_refused_naming_it(tmp_path) -> None:
    path = tmp_path / "q2k.gguf"
    write(path, {"w": "Q2_K"})
    with pytest.raises(ValueError, match=r"q2k.gguf: tensor 'w' has type Q2_K, which dabba does not read"):
        read_gguf(path)


@pytest.mark.parametrize("cut", [10, 100, -1, -300])
def test_a_truncated_file_is_refused(good, tmp_path, cut) -> None:
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"cut.gguf: "):
        read_gguf(bad)


def header_offsets(data: bytes) -> dict[str, int]:
    """Where the counts sit: n_tensors at 8, n_kv at 16; the first KV's array count, found by its key."""
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # the value type (ARRAY), then the item type
    return {"n_tensors": 8, "n_kv": 16, "array_count": at}


@pytest.mark.parametrize("where, value", [
    ("n_tensors", 2**63), ("n_kv", 2**40), ("array_count", 2**62), ("array_count", 10**9),
])
def test_lying_counts_are_refused_without_walking_them(good, tmp_path, where, value) -> None:
    data = bytearray(good.read_bytes())
    struct.pack_into("<Q", data, header_offsets(bytes(data))[where], value)
    bad = tmp_path / "lies.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"lies.gguf: "):
        read_gguf(bad)


def test_a_scalar_array_whose_count_outruns_the_file(tmp_path) -> None:
    """gguf-py walks an array of scalars item by item, past the end as the count says: a hang."""
    path = tmp_path / "scores.gguf"
    write(path)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.scores"
    struct.pack_into("<Q", data, data.index(key) + len(key) + 8, 2**60)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="an array of 1152921504606846976 items .* runs past the end of the file"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path) -> None:
    for name, content in (("empty.gguf", b""), ("text.gguf", b"not a gguf file at all, just text" * 4),
                          ("version.gguf", b"GGUF" + struct.pack("<I", 99) + bytes(40))):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=name):
            read_gguf(path)
    with pytest.raises(ValueError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")


def test_mutated_headers_are_files_or_value_errors(good, tmp_path) -> None:
    """A few thousand files, each the good one with a few bytes of its header (metadata and tensor
    infos) changed: each reads, or raises ValueError naming the file; nothing else escapes."""
    data = good.read_bytes()
    header_end = data.index(b"q4k") + 64  # past the last tensor info
    rng = np.random.default_rng(48)
    path = tmp_path / "fuzz.gguf"
    outcomes = {"read": 0, "refused": 0}
    interesting = [0, 255, 0x7F, 0x80, 0xFF]
    for _ in range(3000):
        mutated = bytearray(data)
        for _ in range(rng.integers(1, 4)):
            at = int(rng.integers(4, header_end))
            mutated[at] = int(rng.choice(interesting)) if rng.random() < 0.5 else int(rng.integers(0, 256))
        if rng.random() < 0.1:
            mutated = mutated[:int(rng.integers(24, len(mutated)))]
        path.write_bytes(bytes(mutated))
        try:
            read_gguf(path)
            outcomes["read"] += 1
        except ValueError as e:
            assert str(e).startswith(str(path)), e
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and outcomes["read"] > 0, outcomes
