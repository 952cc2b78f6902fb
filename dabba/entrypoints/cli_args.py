"""The engine's command-line flags, generated from the config dataclasses (every option has one
definition and one help text), and the keyword arguments the given ones make."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dabba.config import EngineConfig

_SCALARS = {"int": int, "float": float, "str": str}


def add_config_args(parser: argparse.ArgumentParser, parts: dict[str, type]) -> None:
    """One --flag per field of each config dataclass (except ``model``, which is positional)."""
    for part, klass in parts.items():
        group = parser.add_argument_group(part.replace("_", " "))
        for f in dataclasses.fields(klass):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "").replace("%", "%%")
            type_name = str(f.type).replace(" | None", "")
            if type_name == "bool":
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=f"{help_text} (default: {f.default})")
            else:
                parse = f.metadata.get("parse") or _SCALARS[type_name]
                group.add_argument(flag, dest=f.name, type=_argument_type(parse), default=None,
                                   help=f"{help_text} (default: {f.default})")


def _argument_type(parse: Any) -> Any:
    """``parse`` with its ValueError's message shown by argparse (else it says only "invalid value")."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, EngineConfig.PARTS)


def config_kwargs(args: argparse.Namespace, parts: dict[str, type]) -> dict[str, Any]:
    """Only the flags the user gave: unset ones keep the dataclass defaults."""
    names = {f.name for klass in parts.values() for f in dataclasses.fields(klass)} - {"model"}
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return config_kwargs(args, EngineConfig.PARTS)
