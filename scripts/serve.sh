#!/usr/bin/env bash
# The main job: set up, then serve a model over the OpenAI-compatible API on 127.0.0.1:8000.
# Until the bundled demo model exists, the setup writes a small random-weight checkpoint (with a
# trained tokenizer) to demo-checkpoint/: the server works end to end, the text is noise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f demo-checkpoint/config.json ]; then
    .venv/bin/python -m tools.tiny_checkpoint demo-checkpoint --arch LlamaForCausalLM >/dev/null
fi
exec .venv/bin/dabba serve demo-checkpoint --served-model-name demo "$@"
