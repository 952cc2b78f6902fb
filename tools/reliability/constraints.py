"""Part of phase 3, fuzz: random structured-output constraints, valid and hostile.

Valid ones (regexes, JSON schemas, choices, grammars drawn at random) must be served, and what
the model wrote must satisfy them where it stopped of its own accord. Hostile ones must be 400s
in the error shape naming the field, each for its reason: past one of the server's bounds (sized
from the limits it reports), admitting no output, a dead end reached as it generates (the body's
error, or the stream's error event), a regex that does not parse."""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from dabba.config import ServerConfig

from .common import PhaseResult, Target, error_shape_problem, is_server_error, is_sse, sse_events, stream_error_events

WORDS = ("ab", "cd", "x", "yes", "no", "42", "\u00e9t\u00e9", "a b")


@dataclass(frozen=True)
class ConstraintCase:
    """One request's constraint, and what the server must do with it."""

    name: str
    field: str  # "structured_outputs" or "response_format"
    value: Any
    status: int  # 200, or the 400 it must be
    check: Callable[[str], bool] | None = None  # for a 200 that stopped: its text satisfies the constraint
    code: str | None = None  # a 400's error code, where it has one
    stream: bool = False

    def body(self, model: str, endpoint: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": 24, "temperature": 1.0, self.field: self.value,
                                "stream": self.stream}
        if endpoint == "chat":
            return {**body, "messages": [{"role": "user", "content": "Answer:"}]}
        return {**body, "prompt": "Answer:"}


def random_regex(rng: random.Random, depth: int = 0) -> str:
    pieces = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(4 if depth < 2 else 3)
        if kind == 0:
            pieces.append(re.escape(rng.choice(WORDS)))
        elif kind == 1:
            low = rng.randint(0, 2)
            pieces.append(rng.choice(("[a-f]", "[0-9]", "[xyz]", "\\d")) + "{%d,%d}" % (low, low + rng.randint(1, 3)))
        elif kind == 2:
            pieces.append("(" + "|".join(re.escape(w) for w in rng.sample(WORDS, rng.randint(2, 4))) + ")")
        else:
            pieces.append("(" + random_regex(rng, depth + 1) + ")" + rng.choice(("?", "{1,2}", "")))
    return "".join(pieces)


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kind = rng.randrange(5 if depth < 2 else 4)
    if kind == 0:
        return {"type": "integer", "minimum": -5, "maximum": rng.randint(0, 99)}
    if kind == 1:
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == 2:
        return {"type": "string", "pattern": "^" + random_regex(rng, 2) + "$"}
    if kind == 3:
        return {"type": "boolean"}
    names = rng.sample(("a", "b", "c", "d"), rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def schema_check(schema: dict[str, Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def valid_case(rng: random.Random) -> ConstraintCase:
    kind = rng.randrange(4)
    if kind == 0:
        pattern = random_regex(rng)
        return ConstraintCase(f"regex {pattern!r}", "structured_outputs", {"regex": pattern}, 200,
                              lambda text: re.fullmatch(pattern, text) is not None)
    if kind == 1:
        schema = random_schema(rng)
        fmt = {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": schema}}
        return ConstraintCase(f"schema {json.dumps(schema)[:80]}", "response_format", fmt, 200, schema_check(schema))
    if kind == 2:
        choices = rng.sample(WORDS, rng.randint(1, 5))
        return ConstraintCase(f"choice {choices}", "structured_outputs", {"choice": choices}, 200,
                              lambda text: text in choices)
    words = rng.sample(WORDS, rng.randint(1, 4))
    grammar = "root ::= item (\",\" item){0,%d}\nitem ::= %s" % (rng.randint(0, 3),
                                                                  " | ".join(json.dumps(w) for w in words))
    item = "(" + "|".join(re.escape(w) for w in words) + ")"
    return ConstraintCase(f"grammar of {words}", "structured_outputs", {"grammar": grammar}, 200,
                          lambda text: re.fullmatch(f"{item}(,{item})*", text) is not None)


def hostile_cases(limits: ServerConfig) -> list[ConstraintCase]:
    """One for each way a constraint is refused, sized to the server's bounds."""
    too_long_regex = "a" * (limits.max_constraint_regex_length + 1)
    many_rules = "root ::= r0\n" + "\n".join(f'r{i} ::= "a"' for i in range(limits.max_constraint_grammar_rules))
    big = "x" * (limits.max_constraint_bytes + 1)
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": list(range(limits.max_constraint_enum_values + 1))}}}
    cases = [
        ConstraintCase("an enum past the bound", "response_format", fmt, 400, code="constraint_too_large"),
        ConstraintCase("choices past the bound", "structured_outputs",
                       {"choice": [str(i) for i in range(limits.max_constraint_enum_values + 1)]}, 400,
                       code="constraint_too_large"),
        ConstraintCase("a regex past the bound", "structured_outputs", {"regex": too_long_regex}, 400,
                       code="constraint_too_large"),
        ConstraintCase("a pattern past the bound", "structured_outputs",
                       {"json": {"type": "string", "pattern": too_long_regex}}, 400, code="constraint_too_large"),
        ConstraintCase("grammar rules past the bound", "structured_outputs", {"grammar": many_rules}, 400,
                       code="constraint_too_large"),
        ConstraintCase("a grammar that admits nothing", "structured_outputs", {"grammar": "root ::= root"}, 400),
        ConstraintCase("a dead end", "structured_outputs", {"grammar": 'root ::= "a" b\nb ::= b'}, 400),
        ConstraintCase("a dead end, streamed", "structured_outputs", {"grammar": 'root ::= "a" b\nb ::= b'}, 400,
                       stream=True),
        ConstraintCase("a regex that does not parse", "structured_outputs", {"regex": "a(b"}, 400),
    ]
    if len(big) + 1024 < limits.max_request_body_bytes:  # else the body's own bound answers first
        cases.append(ConstraintCase("a constraint past the byte bound", "structured_outputs", {"regex": big}, 400,
                                    code="constraint_too_large"))
    return cases


def case_problems(case: ConstraintCase, r: httpx.Response) -> list[str]:
    if case.stream and r.status_code == 200 and is_sse(r):  # an error found as it generates: the error event
        events, problems = sse_events(r.text)
        errors = stream_error_events(events)
        if case.status == 200:
            return problems + ([f"error events: {errors[:2]}"] if errors else [])
        if not errors or errors[-1].get("param") != case.field:
            return problems + [f"expected an error event naming {case.field}, got {errors[-1:] or 'none'}"]
        return problems
    if r.status_code != case.status:
        return [f"HTTP {r.status_code}, expected {case.status}: {r.text[:200]!r}"]
    if case.status != 200:
        problem = error_shape_problem(r)
        if problem:
            return [problem]
        error = r.json()["error"]
        problems = [] if error["param"] == case.field else [f"param {error['param']!r}, expected {case.field!r}"]
        if case.code is not None and error["code"] != case.code:
            problems.append(f"code {error['code']!r}, expected {case.code!r}")
        return problems
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    if choice["finish_reason"] == "stop" and case.check is not None and not case.check(text):
        return [f"the output {text!r} does not satisfy the constraint"]
    return []


def fuzz_constraints(target: Target, result: PhaseResult, cases: int, seed: int) -> None:
    """``cases`` random valid constraints, then every hostile one, on both endpoints in turn."""
    rng = random.Random(seed)
    plan = [valid_case(rng) for _ in range(cases)] + hostile_cases(target.limits)
    with target.client() as client:
        for k, case in enumerate(plan):
            endpoint = ("completions", "chat")[k % 2]
            path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
            result.add("constraint_cases")
            try:
                r = client.post(path, json=case.body(target.model, endpoint))
            except httpx.HTTPError as e:
                result.failures.append(f"constraint {case.name}: {type(e).__name__}: {e}")
                continue
            result.server_errors += is_server_error(r)
            result.add_to("constraints", str(r.status_code))
            result.failures += [f"constraint {case.name} ({endpoint}): {p}" for p in case_problems(case, r)]
