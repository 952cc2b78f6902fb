#!/usr/bin/env bash
# Create the peer venv .venv-gptqmodel/ (GPTQModel 7.7.0, CPU) used by
# tests/quantization/test_peer_gptqmodel.py to check that dabba's GPTQ/AWQ checkpoints interoperate
# with an independent implementation. Quick when the venv already exists and imports.
# The peer is never a dependency of dabba itself; it lives in its own venv.
#
# torch stays at 2.13.0 (the CPU wheel on these machines); GPTQModel 7.7.0 asks for torch>=2.14.1,
# so it is installed with --no-deps after its dependencies, which are pinned in
# scripts/peer-gptqmodel-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gptqmodel
REQS=scripts/peer-gptqmodel-requirements.txt
GPTQMODEL_VERSION=7.7.0
STAMP="$VENV/.requirements.sha256"
want_stamp="$(cat "$REQS" | sha256sum | cut -d' ' -f1) gptqmodel==$GPTQMODEL_VERSION"

check() {
    "$VENV/bin/python" - "$GPTQMODEL_VERSION" <<'PY'
import sys
import torch, transformers, optimum, gptqmodel  # noqa: F401
from gptqmodel import GPTQModel, BACKEND, QuantizeConfig  # noqa: F401
assert gptqmodel.__version__ == sys.argv[1], gptqmodel.__version__
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
PY
}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want_stamp" ] && check >/dev/null 2>&1; then
    exit 0
fi

echo "peer-gptqmodel: installing GPTQModel $GPTQMODEL_VERSION into $VENV" >&2
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
rm -f "$STAMP"
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet -r "$REQS"
"$VENV/bin/pip" install --quiet --no-deps "gptqmodel==$GPTQMODEL_VERSION"
if ! out="$(check 2>&1)"; then
    echo "$out" >&2
    echo "peer-gptqmodel: $VENV was installed but GPTQModel does not import (see above)" >&2
    exit 1
fi
echo "$want_stamp" > "$STAMP"
echo "peer-gptqmodel: ready ($VENV)" >&2
