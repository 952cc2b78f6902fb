#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU only, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
