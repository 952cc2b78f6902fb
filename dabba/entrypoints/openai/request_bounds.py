"""What a request asks to constrain its output with, and the server's bounds on a request
(ServerConfig): each refusal a 400 naming the field."""
from __future__ import annotations

from dabba.config import ServerConfig
from dabba.entrypoints.openai.errors import OpenAIError
from dabba.entrypoints.openai.protocol import SamplingFields
from dabba.structured_output import StructuredOutputsParams


def check_bounds(req: SamplingFields, limits: ServerConfig) -> None:
    """The server's bounds on one request (ServerConfig), each a 400 naming its field."""
    if req.n > limits.max_n:
        raise OpenAIError(400, f"n must be <= {limits.max_n} (the server's --max-n), got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > limits.max_stop_sequences:
        raise OpenAIError(400, f"stop takes at most {limits.max_stop_sequences} strings (the server's "
                               f"--max-stop-sequences), got {len(stops)}", param="stop")
    if any(len(s) > limits.max_stop_length for s in stops):
        raise OpenAIError(400, f"stop strings must be at most {limits.max_stop_length} characters long (the "
                               "server's --max-stop-length)", param="stop")


def check_constraint(constraint: StructuredOutputsParams | None, param: str, limits: ServerConfig) -> None:
    """The server's bounds on what a constraint may cost to compile, each a 400 naming the
    field the constraint came from."""
    if constraint is None:
        return
    size = constraint.size()
    for value, limit, what, flag in (
            (size.bytes, limits.max_constraint_bytes, "bytes of constraint", "max-constraint-bytes"),
            (size.enum_values, limits.max_constraint_enum_values, "enum/const values or choices",
             "max-constraint-enum-values"),
            (size.regex_length, limits.max_constraint_regex_length, "characters of regex",
             "max-constraint-regex-length"),
            (size.grammar_rules, limits.max_constraint_grammar_rules, "grammar rules",
             "max-constraint-grammar-rules")):
        if value > limit:
            raise OpenAIError(400, f"{param} has {value} {what}; the server takes at most {limit} (its --{flag})",
                              param=param, code="constraint_too_large")


def constraint_field(req: SamplingFields) -> str:
    """The request field a constraint comes from, for its errors."""
    return "response_format" if req.response_format is not None and req.response_format.type != "text" \
        else "structured_outputs"


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """``response_format`` (json_object, json_schema; text is no constraint) or vLLM's
    ``structured_outputs``, never both. A json_schema's ``strict`` changes nothing: the schema
    is always enforced."""
    fmt = req.response_format
    field = constraint_field(req)
    if fmt is not None and fmt.type != "text" and req.structured_outputs is not None:
        raise OpenAIError(400, "set response_format or structured_outputs, not both", param="response_format")
    try:
        if field == "response_format":
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        if req.structured_outputs is None:
            return None
        return StructuredOutputsParams.from_dict(req.structured_outputs)
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, str(e), param=field) from None
