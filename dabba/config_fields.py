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


def parse_duration(value: object, field_name: str = "keep_alive") -> float:
    """Seconds: a number, or a string such as "90", "30s", "5m", "1h" (Ollama's durations);
    ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{field_name} must be a number of seconds or a duration such as '5m', got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
        unit = next((u for u in units if text.endswith(u)), "")
        try:
            seconds = float(text[:len(text) - len(unit)]) * units.get(unit, 1)
        except ValueError:
            raise ValueError(f"{field_name} must be a number of seconds or a duration such as '5m', "
                             f"got {value!r}") from None
    else:
        seconds = float(value)
    if seconds != seconds or abs(seconds) == float("inf"):
        raise ValueError(f"{field_name} must be finite, got {value!r}")
    return seconds


def parse_keep_alive(value: object, field_name: str = "keep_alive") -> float | None:
    """Ollama's keep_alive: a duration (parse_duration); a negative one keeps the model loaded
    for good (None); 0 unloads it once idle."""
    seconds = parse_duration(value, field_name)
    return None if seconds < 0 else seconds
