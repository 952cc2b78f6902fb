from __future__ import annotations

from pathlib import Path

import pytest

from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main


@pytest.fixture(scope="session")
def demo_quantized(tmp_path_factory) -> dict[str, Path]:
    """The demo model through `dabba quantize` at INT4 g128, once per method (about 40 s together)."""
    out = tmp_path_factory.mktemp("demo-quantized")
    for method in ("gptq", "awq", "rtn"):
        assert main(["quantize", DEMO_MODEL, str(out / method), "--method", method]) == 0
    return {method: out / method for method in ("gptq", "awq", "rtn")}
