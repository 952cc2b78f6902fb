"""Builds the native CPU kernels into the package: one library per instruction-set variant of the
build machine's architecture (dabba/ops/kernel_variants.py), into dabba/_kernels/, so that an
installed wheel needs no compiler and picks its variant at load time (dabba/ops/native.py).

An editable install (pip install -e .) skips them: a developer's kernels are compiled on first
use from the sources they are editing, into torch's extension cache under the variant's name.
The rest of the metadata is in pyproject.toml.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _variants_module():
    """dabba/ops/kernel_variants.py alone: importing the package would import all of dabba."""
    spec = importlib.util.spec_from_file_location("_dabba_kernel_variants", ROOT / "dabba" / "ops" / "kernel_variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _extensions() -> tuple[list, dict]:
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    kv = _variants_module()
    sources = [f"dabba/csrc/{name}" for name in kv.SOURCES]
    modules = [CppExtension(f"dabba._kernels.{kv.library_name(v)}", sources,
                            # -g0: Python's build flags add debug info, 14x the library's size
                            extra_compile_args=[*kv.COMMON_CFLAGS, *v.cflags, "-g0"],
                            extra_link_args=list(kv.COMMON_LDFLAGS))
               for v in kv.variants_for()]

    class BuildKernels(BuildExtension):
        def run(self) -> None:
            if getattr(self, "editable_mode", False):
                return  # built on first use instead (module docstring)
            super().run()

        def build_extension(self, ext) -> None:
            # every variant compiles the same sources: each in its own directory, or their objects collide
            base = self.build_temp
            self.build_temp = str(Path(base) / ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    return modules, {"build_ext": BuildKernels.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
