"""The native CPU kernels must build on the machines dabba targets (CI included): elsewhere the
engine falls back to plain PyTorch, and the kernel tests skip, so this is what notices."""
from __future__ import annotations

from dabba.ops.native import load_cpu_ops


def test_native_cpu_kernels_build_here() -> None:
    load_cpu_ops.cache_clear()
    assert load_cpu_ops(), "the native CPU kernels failed to build (see the warning logged by dabba.ops.native)"
