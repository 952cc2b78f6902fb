"""A GGUF file (llama.cpp's container), read defensively: its metadata and its tensors as
memory-mapped views, parsed by llama.cpp's own gguf-py and then checked, because GGUF files come
from strangers and the format's parsers have a history of memory-safety bugs.

Everything wrong with a file is one ValueError naming the file and the problem: a bad magic or
version, a truncated header, an array whose count outruns the file (gguf-py would loop over it
item by item, for as long as the count says), an unknown or unsupported tensor type, a shape that
overflows or does not tile its type's blocks, data misaligned, overlapping or past the end.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# What dabba reads: every type the usual llama-quantize presets (Q4_0, Q4_K_S/M, Q5_K_S/M, Q6_K,
# Q8_0) write, and the float ones the converter writes.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# one shard of a file llama.cpp's gguf-split cut in pieces: name-00001-of-00003.gguf
SPLIT_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"  # split.no counts from 0
MAX_SHARDS = 99999  # what five digits name
MAX_DIMS = 4
MAX_ELEMENTS = 2**48  # past any model; keeps every size computation far from int64's end


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``shape`` in PyTorch's order (rows first: ggml's ne reversed),
    ``data`` its bytes in ``file`` (a read-only memory-mapped uint8 view), from byte ``offset``
    (the shard that holds it, in a split file)."""

    name: str
    type_name: str  # "Q4_K", "F16", ...
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int
    file: Path


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file, or a split one whole: ``path`` the (first) file, ``metadata`` the first
    shard's, ``tensors`` every shard's."""

    path: Path
    metadata: dict[str, Any]  # key -> str, int, float, bool or a list of them
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ValueError(f"{self.path}: the GGUF file lacks the metadata key {key!r}")
        return self.metadata[key]


def _bounded_reader() -> type:
    """gguf-py's GGUFReader, refusing an array whose count the rest of the file cannot hold
    before it walks the array item by item."""
    from gguf import GGUFReader, GGUFValueType

    min_item_bytes = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}

    class BoundedReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == GGUFValueType.ARRAY:
                item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
                if len(item_type) and len(count):
                    itype = GGUFValueType(int(item_type[0]))
                    scalar = self.gguf_scalar_to_np.get(itype)
                    size = min_item_bytes.get(itype) or (np.dtype(scalar).itemsize if scalar else 1)
                    if int(count[0]) > (len(self.data) - orig_offs - 12) // size:
                        raise ValueError(f"an array of {int(count[0])} items at offset {orig_offs} runs past the end "
                                         "of the file")
            return super()._get_field_parts(orig_offs, raw_type)

    return BoundedReader


def _value(field: Any) -> Any:
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.STRING and not isinstance(value, str):
        raise ValueError(f"metadata {field.name!r} is not a string")
    return value


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensors, checked; a ValueError naming the file otherwise. The first
    shard of a split file (llama.cpp's gguf-split, or the converter's --split-max-*) reads every
    shard, found beside it by llama.cpp's naming, as one file."""
    first = _checked(Path(path))
    count = first.get(SPLIT_COUNT, 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"{path}: metadata {SPLIT_COUNT!r} is {count!r}, not a shard count")
    if count == 1:
        return first
    names = SPLIT_SHARD.search(first.path.name)
    if first.get(SPLIT_NO) != 0 or names is None or names.group(1) != "00001" or int(names.group(2)) != count:
        raise ValueError(f"{path}: shard {first.get(SPLIT_NO)!r} of a GGUF file split in {count}: give its first "
                         f"shard, named <name>-00001-of-{count:05d}.gguf")
    tensors = dict(first.tensors)
    for number, name in enumerate(shard_names(first.path.name)[1:], start=1):
        shard_path = first.path.with_name(name)
        shard = _checked(shard_path)
        if shard.get(SPLIT_NO) != number or shard.get(SPLIT_COUNT) != count:
            raise ValueError(f"{shard_path}: not shard {number + 1} of {count} ({SPLIT_NO} {shard.get(SPLIT_NO)!r}, "
                             f"{SPLIT_COUNT} {shard.get(SPLIT_COUNT)!r})")
        for name, tensor in shard.tensors.items():
            if name in tensors:
                raise ValueError(f"{shard_path}: tensor {name!r} is in two shards")
            tensors[name] = tensor
    expected = first.get(SPLIT_TENSORS)
    if expected is not None and expected != len(tensors):
        raise ValueError(f"{path}: {SPLIT_TENSORS} says {expected!r} tensors, the {count} shards hold {len(tensors)}")
    return GGUFFile(first.path, first.metadata, tensors)


def shard_names(name: str) -> list[str]:
    """A split file's first shard's name (or path) -> every shard's, as llama.cpp names them; any
    other name -> itself alone."""
    match = SPLIT_SHARD.search(name)
    if match is None:
        return [name]
    count = int(match.group(2))
    return [f"{name[:match.start()]}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _checked(path: Path) -> GGUFFile:
    """One file, its errors a ValueError naming it."""
    try:
        return _read(path)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: not a usable GGUF file: {message}") \
            from None
    except (IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, RecursionError, MemoryError,
            OSError) as e:  # gguf-py reading past the end, or a field of the wrong type
        raise ValueError(f"{path}: not a usable GGUF file: {type(e).__name__}: {e}") from None


def _read(path: Path) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: {size} bytes is too short for a GGUF header")
    reader = _bounded_reader()(path, "r")
    metadata = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors: dict[str, GGUFTensor] = {}
    spans = []
    for t in reader.tensors:
        type_name = GGMLQuantizationType(t.tensor_type).name
        if type_name not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name!r} has type {type_name}, which dabba does not read (it reads "
                             f"{', '.join(SUPPORTED_TYPES)})")
        dims = [int(d) for d in t.shape]
        if not 1 <= len(dims) <= MAX_DIMS or any(d < 1 for d in dims):
            raise ValueError(f"{path}: tensor {t.name!r} has dimensions {dims}")
        n_elements = 1
        for d in dims:
            n_elements *= d
            if n_elements > MAX_ELEMENTS:
                raise ValueError(f"{path}: tensor {t.name!r} has dimensions {dims}, too many elements")
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        if dims[0] % block:
            raise ValueError(f"{path}: tensor {t.name!r} has rows of {dims[0]} values, not whole {type_name} blocks "
                             f"of {block}")
        n_bytes = n_elements // block * type_size
        start = int(t.data_offset)
        if start % reader.alignment:
            raise ValueError(f"{path}: tensor {t.name!r} starts at offset {start}, not aligned to {reader.alignment}")
        if start + n_bytes > size:
            raise ValueError(f"{path}: tensor {t.name!r} ({n_bytes} bytes at offset {start}) runs past the end of "
                             f"the file ({size} bytes): truncated?")
        spans.append((start, start + n_bytes, t.name))
        raw = reader.data[start:start + n_bytes]
        tensors[t.name] = GGUFTensor(t.name, type_name, tuple(reversed(dims)), raw, start, path)
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{path}: tensors {name!r} and {other!r} overlap")
    return GGUFFile(path, metadata, tensors)
