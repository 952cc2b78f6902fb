"""What constrains a request's output, as vLLM's StructuredOutputsParams spells it. Plain data:
the core, the sampling params and the server carry it; only grammar.py turns it into a grammar."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from dabba.errors import InvalidRequest


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest("structured_outputs", message)


# The constraint kinds, in the order their fields are declared; exactly one is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ConstraintSize:
    """What bounds a constraint's compile cost, for a server to hold against its limits."""

    bytes: int  # of its canonical text (a schema's compact JSON, the regex, the grammar, the choices)
    enum_values: int  # enum and const values in a JSON schema, or choices
    regex_length: int  # the regex, or the longest pattern in a JSON schema (patternProperties too)
    grammar_rules: int


def _schema_size(schema: Any) -> tuple[int, int]:
    """(enum and const values, longest pattern) anywhere in a JSON schema; iterative, so that a
    deeply nested schema cannot exhaust the stack."""
    values, longest = 0, 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("enum"), list):
            values += len(node["enum"])
        if "const" in node:
            values += 1
        if isinstance(node.get("pattern"), str):
            longest = max(longest, len(node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            longest = max([longest, *map(len, node["patternProperties"])])
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return values, longest


@dataclass(frozen=True)
class ThinkingSpan:
    """A reasoning model's thinking, which a constraint does not hold: it holds the answer, from
    the token after ``end`` (the closing tag's id). ``start``: the reply thinks only if it opens
    with this token (else it is all answer, constrained from its first token); None: the reply
    starts inside the thinking (the prompt opened it). ``budget``: the most tokens the thinking
    may take; then the closing tag is the only token allowed (None: no bound)."""

    end: int
    start: int | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("end", "start", "budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidRequest("thinking", f"thinking.{name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (EBNF/GBNF text, root rule ``root``) or
    ``json_object`` (any JSON object). ``disable_any_whitespace`` makes JSON output compact: no
    whitespace between tokens beyond what the schema's strings hold (weak models otherwise
    wander into runs of whitespace). An invalid value raises ValueError naming the field."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise _invalid(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_kinds) if set_kinds else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise _invalid(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _invalid(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _invalid(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _invalid(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _invalid(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.json_object not in (None, True, False):
            raise _invalid(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _invalid("structured_outputs.disable_any_whitespace must be a boolean, got "
                             f"{self.disable_any_whitespace!r}")

    @classmethod
    def from_dict(cls, value: Any) -> "StructuredOutputsParams":
        """From the server's ``structured_outputs`` field; unknown keys are an error."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _invalid(f"structured_outputs must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise _invalid(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def size(self) -> ConstraintSize:
        kind, text, _ = self.key
        values, longest = 0, 0
        if kind == "json":  # the schema as given: the key's text is its canonical JSON
            values, longest = _schema_size(json.loads(self.json) if isinstance(self.json, str) else self.json)
        elif kind == "choice":
            values = len(self.choice)
        elif kind == "regex":
            longest = len(self.regex)
        rules = self.grammar.count("::=") if kind == "grammar" else 0
        return ConstraintSize(len(text.encode("utf-8", "surrogatepass")), values, longest, rules)

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal constraints share one compiled grammar: (kind, canonical text, whitespace)."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace
