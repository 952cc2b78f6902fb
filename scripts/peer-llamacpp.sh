#!/usr/bin/env bash
# llama.cpp as the GGUF tests' peer, two parts, each quick when already done:
# - its source tree (from the llama-cpp-python sdist on PyPI) unpacked into .peers/llama.cpp/: its
#   convert_hf_to_gguf.py and gguf-py write the files tests/test_gguf_models.py serves (dabba's venv
#   runs the converter), and its models/templates (the model families' own chat templates, kept for
#   llama.cpp's tests) are tests/entrypoints/test_vendor_templates.py's;
# - llama-cpp-python built for this CPU into its own venv, .venv-llamacpp/ (about 5 minutes on 2
#   cores): it quantizes those files with llama.cpp's own llama_model_quantize and computes the
#   reference tokens and log-probabilities of tests/test_gguf_llamacpp.py (tests/peer_llamacpp.py).
# Never a dependency of dabba.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DEST=.peers/llama.cpp
STAMP=.peers/llama.cpp.version
VENV=.venv-llamacpp
if ! { [ -f "$DEST/convert_hf_to_gguf.py" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; }; then
    scripts/setup.sh  # its pip downloads the sdist
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    .venv/bin/pip download --quiet "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$TMP"
    tar xzf "$TMP/llama_cpp_python-$VERSION.tar.gz" -C "$TMP" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    rm -rf "$DEST"
    mkdir -p .peers
    mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
    echo "$VERSION" > "$STAMP"
fi
check() {
    "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')"
}
if [ -x "$VENV/bin/python" ] && check >/dev/null 2>&1; then
    exit 0
fi
scripts/setup.sh
rm -rf "$VENV"
"$(readlink -f .venv/bin/python)" -m venv "$VENV"
CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install --quiet "llama-cpp-python==$VERSION"
check
