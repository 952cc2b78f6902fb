"""Phase 3, fuzz: schemathesis cases from /openapi.json, valid and invalid, then random
structured-output constraints, valid and hostile (constraints.py)."""
from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx

from .common import (PhaseResult, Target, error_shape_problem, is_json, is_server_error, is_sse, named_events,
                     sse_events, stream_error_events, timed, wait_idle)
from .constraints import fuzz_constraints


# ---- phase 3: fuzz -----------------------------------------------------------------------------------

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# each generation path's output-length field (chat takes max_completion_tokens too)
LENGTH_KEYS = {"/v1/messages": ("max_tokens",), "/v1/responses": ("max_output_tokens",)}
TEXT_BODIES = {"/metrics": "text/plain", "/health": ""}  # 2xx bodies that are not JSON: content type prefix


@dataclass(frozen=True)
class FuzzConfig:
    cases: int = 240  # in all; the POST operations share what the GETs leave, in both modes
    gets_per_operation: int = 2  # a GET without parameters has one case only
    max_tokens_cap: int = 8
    seed: int | None = 0  # None: a fresh hypothesis seed
    constraint_cases: int = 16  # random valid constraints (the hostile ones come on top)


def adjust_body(body: Any, cap: int, model: str | None, path: str = "/v1/completions") -> Any:
    """Generated generation bodies may ask for max_model_len tokens x n samples (and leaving
    max_tokens out means as many as fit): each length is lowered to ``cap`` tokens before
    sending, so a few hundred cases take seconds. Only valid lengths change; invalid ones (0,
    negative, floats, strings) reach the server as generated. ``model``: the served name, put in
    place of a generated string (else nearly every valid case would be a 404 for its model; the
    malformed table has the wrong names)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    keys = LENGTH_KEYS.get(path, ("max_tokens", "max_completion_tokens"))
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if all(body.get(key) is None for key in keys):
        body[keys[0]] = cap
    return body


def fuzz_response_problems(path: str, r: httpx.Response) -> list[str]:
    """Never a 5xx; 4xx in OpenAI's error shape; 2xx JSON, or a stream ending in [DONE]."""
    if r.status_code >= 500:
        return [f"HTTP {r.status_code}: {r.text[:200]!r}"]
    if 400 <= r.status_code < 500:
        problem = error_shape_problem(r)
        return [f"HTTP {r.status_code}: {problem}"] if problem else []
    if not 200 <= r.status_code < 300:
        return [f"unexpected HTTP {r.status_code}"]
    if is_sse(r):
        events, problems = sse_events(r.text, named_events(path))
        errors = stream_error_events(events)
        return problems + ([f"error events in a 200 stream: {errors[:2]}"] if errors else [])
    if is_json(r):
        try:
            r.json()
        except ValueError:
            return [f"a JSON content type with a body that is not JSON: {r.text[:120]!r}"]
        return []
    if path in TEXT_BODIES and r.headers.get("content-type", "").startswith(TEXT_BODIES[path]):
        return []
    return [f"HTTP {r.status_code} with content type {r.headers.get('content-type')!r}"]


def send_case(client: httpx.Client, target: Target, case: Any, cap: int, positive: bool
              ) -> tuple[str, httpx.Response]:
    """A schemathesis case sent with httpx (the same client for every case), its body adjusted
    (see adjust_body; the model name in positive cases only) and written with NaN/Infinity
    literals where generated."""
    kwargs = case.as_transport_kwargs(base_url=target.url, headers=target.auth())
    path = urllib.parse.urlsplit(kwargs["url"]).path
    content: bytes | None = None
    if "json" in kwargs:
        body = kwargs["json"]
        if path in GENERATION_PATHS:
            body = adjust_body(body, cap, target.model if positive else None, path)
        elif positive and isinstance(body, dict) and isinstance(body.get("model"), str):
            body = {**body, "model": target.model}
        content = json.dumps(body, allow_nan=True).encode()
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        content = data if isinstance(data, bytes) else str(data).encode()
    headers = {str(k): str(v) for k, v in (kwargs.get("headers") or {}).items()}
    r = client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params") or None, headers=headers,
                       content=content, cookies=kwargs.get("cookies") or None)
    return path, r


def fuzz_operation(operation: Any, mode: Any, max_examples: int, seed: int | None,
                   check: Callable[[Any], None]) -> None:
    """Runs ``check`` on up to ``max_examples`` hypothesis-generated cases of one operation (no
    shrinking, no example database: a failure is recorded by ``check``, never raised)."""
    import hypothesis

    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=[hypothesis.Phase.generate],
                         suppress_health_check=list(hypothesis.HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        check(case)

    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()


def schema_operations(target: Target) -> Iterator[Any]:
    import schemathesis
    from schemathesis.core.result import Ok

    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", timeout=target.timeout_s)
    for result in schema.get_all_operations():
        if isinstance(result, Ok):
            yield result.ok()


@timed
def run_fuzz(target: Target, config: FuzzConfig = FuzzConfig()) -> PhaseResult:
    """schemathesis cases of every operation in /openapi.json: the POSTs in positive and
    negative modes, the GETs positive (they take no parameters to break)."""
    import hypothesis.errors
    from schemathesis import GenerationMode

    result = PhaseResult("fuzz", {"cases": 0})
    operations = list(schema_operations(target))
    posts = [op for op in operations if op.method.upper() == "POST"]
    gets = [op for op in operations if op.method.upper() != "POST"]
    result.counts["operations"] = len(operations)
    if not posts:
        result.failures.append("the schema has no POST operations")
        return result
    per_post = max(1, (config.cases - config.gets_per_operation * len(gets)) // (2 * len(posts)))
    plan = [(op, GenerationMode.POSITIVE, config.gets_per_operation) for op in gets]
    plan += [(op, mode, per_post) for op in posts for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    with target.client(auth=False) as client:
        for k, (op, mode, max_examples) in enumerate(plan):
            label = f"{op.method.upper()} {op.path} {mode.value}"

            def check(case: Any) -> None:
                result.add("cases")
                result.add_to(label, "cases")
                try:
                    path, r = send_case(client, target, case, config.max_tokens_cap,
                                                positive=mode == GenerationMode.POSITIVE)
                except httpx.HTTPError as e:
                    result.failures.append(f"{label}: {type(e).__name__}: {e}")
                    return
                result.add(f"{r.status_code // 100}xx")
                result.add_to(label, str(r.status_code))
                result.server_errors += is_server_error(r)
                problems = fuzz_response_problems(path, r)
                if problems:
                    body = r.request.content[:300].decode(errors="replace")
                    result.failures += [f"{label}: {p} (request body {body!r})" for p in problems]

            try:
                fuzz_operation(op, mode, max_examples, None if config.seed is None else config.seed + k, check)
            except hypothesis.errors.Unsatisfiable:
                if mode != GenerationMode.NEGATIVE:
                    raise
                result.add("operations_without_invalid_cases")  # a path parameter alone: any string is one
            except Exception as e:  # schemathesis/hypothesis could not generate (or send) its cases
                result.failures.append(f"{label}: fuzzing stopped: {type(e).__name__}: {e}")
    fuzz_constraints(target, result, config.constraint_cases, config.seed or 0)
    problem = wait_idle(target)
    if problem:
        result.failures.append(f"after the fuzz: {problem}")
    return result
