"""Structured outputs: output constrained to a JSON schema, a regex, a set of choices or a grammar
(params.py, no dependencies), compiled and matched by xgrammar (grammar.py, manager.py)."""
from dabba.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
