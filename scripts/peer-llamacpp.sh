#!/usr/bin/env bash
# Unpack llama.cpp's source tree (from the llama-cpp-python sdist on PyPI) into .peers/llama.cpp/:
# its convert_hf_to_gguf.py and gguf-py write the GGUF files tests/test_gguf_models.py serves, as a
# llama.cpp user would have them. Nothing is built; dabba's venv runs the converter. Quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DEST=.peers/llama.cpp
STAMP=.peers/llama.cpp.version
if [ -f "$DEST/convert_hf_to_gguf.py" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
scripts/setup.sh  # its pip downloads the sdist
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
.venv/bin/pip download --quiet "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$TMP"
tar xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" "llama_cpp_python-$VERSION/vendor/llama.cpp"
rm -rf "$DEST"
mkdir -p .peers
mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
echo "$VERSION" > "$STAMP"
