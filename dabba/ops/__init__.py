"""The operations under every layer: the native CPU kernels' bindings and the variant the CPU
loads (native.py, kernel_variants.py, over dabba/csrc/), and the activations (activation.py)."""
