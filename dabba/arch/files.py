"""Reading a checkpoint's JSON files so that a broken one is a ValueError naming the file (the CLI
prints it on one line), never a bare decoder error or a traceback."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json and its kin)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value
