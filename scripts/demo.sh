#!/usr/bin/env bash
# The main job: set up, then generate text with dabba. Until the bundled demo model exists, the
# setup writes a small random-weight checkpoint (with a trained tokenizer) to demo-checkpoint/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -f demo-checkpoint/config.json ]; then
    .venv/bin/python -m tools.tiny_checkpoint demo-checkpoint --arch LlamaForCausalLM >/dev/null
fi
exec .venv/bin/dabba generate demo-checkpoint --prompt "Return the JSON object" --prompt "The list of" --max-tokens 32 "$@"
