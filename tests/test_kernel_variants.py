"""Which instruction-set variant of the native kernels a CPU takes (dabba/ops/kernel_variants.py)."""
from __future__ import annotations

import pytest

from dabba.ops import kernel_variants as kv

SAPPHIRE_RAPIDS = dict.fromkeys(("avx", "avx2", "fma3", "f16c", "bmi", "bmi2", "lzcnt", "avx512_f", "avx512_bw",
                                 "avx512_cd", "avx512_dq", "avx512_vl", "avx512_bf16", "avx512_vnni", "amx_tile"), True)
SKYLAKE_X = {k: v for k, v in SAPPHIRE_RAPIDS.items() if k not in ("avx512_bf16", "avx512_vnni", "amx_tile")}
ZEN2 = dict.fromkeys(("avx", "avx2", "fma3", "f16c", "bmi", "bmi2", "lzcnt"), True)
SANDY_BRIDGE = {"avx": True, "sse4_2": True}


@pytest.mark.parametrize("caps, expected", [(SAPPHIRE_RAPIDS, "avx512"), (SKYLAKE_X, "avx2"), (ZEN2, "avx2"),
                                            (SANDY_BRIDGE, "generic"), ({}, "generic")])
def test_the_cpu_takes_the_best_variant_it_can_run(caps, expected):
    assert kv.select_variant(caps, machine="x86_64").name == expected


def test_other_architectures_build_and_take_the_generic_variant():
    assert [v.name for v in kv.variants_for("aarch64")] == ["generic"]
    assert kv.select_variant(SAPPHIRE_RAPIDS, machine="aarch64").name == "generic"
    assert [v.name for v in kv.variants_for("x86_64")] == ["avx512", "avx2", "generic"]


def test_the_override_picks_a_runnable_variant():
    assert kv.select_variant(SAPPHIRE_RAPIDS, machine="x86_64", override="avx2").name == "avx2"
    assert kv.select_variant(SAPPHIRE_RAPIDS, machine="x86_64", override="generic").name == "generic"


def test_the_override_refuses_what_the_cpu_cannot_run_and_unknown_names():
    with pytest.raises(ValueError, match="DABBA_CPU_ISA=avx512: this CPU lacks avx512_bf16, avx512_vnni"):
        kv.select_variant(SKYLAKE_X, machine="x86_64", override="avx512")
    with pytest.raises(ValueError, match=r"DABBA_CPU_ISA='avx9': expected one of avx512, avx2, generic"):
        kv.select_variant(SAPPHIRE_RAPIDS, machine="x86_64", override="avx9")
    with pytest.raises(ValueError, match="expected one of generic on aarch64"):
        kv.select_variant(SAPPHIRE_RAPIDS, machine="aarch64", override="avx2")


def test_each_variant_has_its_own_library_name():
    names = {kv.library_name(v) for v in kv.VARIANTS}
    assert len(names) == len(kv.VARIANTS) and all(v.name in kv.library_name(v) for v in kv.VARIANTS)


# The suites that exercise the kernels: CI runs them on every variant this CPU can execute, not
# only the one it takes, so the AVX2 and generic builds are compiled and checked on every commit.
# Of the parity tests, those whose engines run the kernels in prompts and decodes; the others vary
# the scheduling (preemption, prefix caching) or turn the kernels off, the same on every variant.
KERNEL_SUITES = ("tests/test_native.py", "tests/layers", "tests/attention", "tests/test_native_layer_loop.py",
                 "tests/quantization/test_int4_linear.py", "tests/quantization/test_gguf_linear.py",
                 "tests/quantization/test_w8a8_linear.py",
                 "tests/test_sampling.py",
                 "tests/test_parity.py::test_greedy_matches_transformers",
                 "tests/test_parity.py::test_greedy_with_chunked_prefill")


def _other_runnable_variants() -> list[str]:
    import torch

    caps = torch.cpu.get_capabilities()
    default = kv.select_variant(caps)
    return [v.name for v in kv.variants_for() if v is not default and not v.missing(caps)]


@pytest.mark.parametrize("variant", _other_runnable_variants())
def test_kernel_suites_pass_on_every_variant_this_cpu_runs(variant, checkpoints, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import share_checkpoints

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, kv.ISA_ENV: variant, **share_checkpoints(checkpoints, tmp_path / "checkpoints.json")}
    probe = subprocess.run([sys.executable, "-c", "from dabba.ops import native; print(native.loaded_variant())"],
                           cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert probe.stdout.strip().splitlines()[-1] == variant, probe.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *KERNEL_SUITES],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
