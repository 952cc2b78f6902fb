#!/usr/bin/env bash
# The main job: set up, then serve the bundled demo model over the OpenAI-compatible API on
# http://127.0.0.1:8000 (model name "demo"). Extra arguments go to `dabba serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/dabba serve "$@"
