"""How configuration fields are written: help text (and a CLI parser) in each field's metadata,
and the parsers of option values that several front ends share."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from typing import Any


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    t = text.strip().lower()
    for suffix, scale in units.items():
        if t.endswith(suffix):
            number = t[: -len(suffix)].strip()
            break
    else:
        number, scale = t, 1
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size in bytes (examples: 4GiB, 512MiB, 1000000)") from None


def json_object(text: str, field_name: str = "value") -> dict[str, Any]:
    """An option's JSON object text -> the dict; ValueError naming ``field_name`` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{field_name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field_name} must be a JSON object, got {type(value).__name__}")
    return value


def _help(text: str, default: Any = dataclasses.MISSING, parse: Any = None) -> Any:
    """A field whose help text (and optional CLI parser) travel in its metadata."""
    metadata = {"help": text, **({"parse": parse} if parse else {})}
    if default is dataclasses.MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)
