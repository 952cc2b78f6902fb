#!/usr/bin/env bash
# Create the project's venv at .venv/ if it is missing and install dabba with its dev extra.
# torch is pinned to 2.13.0: on these machines that is a CPU wheel already on disk (an unpinned
# torch would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
fi
if ! .venv/bin/python -c "import dabba, transformers, pytest, fastapi, openai, anthropic, xgrammar, jsonschema, schemathesis, playwright, ray, gguf, sentencepiece, compressed_tensors, sentence_transformers" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==2.13.0"
    .venv/bin/pip install --quiet -e ".[dev]"
fi
