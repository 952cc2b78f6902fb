"""Load-time quantization streams layer by layer: each layer is quantized, and its full-precision
weight freed, before the loader reads later tensors; safetensors files are read a window at a
time, so their pages do not pile up in the process's memory."""
from __future__ import annotations

import itertools
import shutil
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dabba import LLM
from dabba.arch.config import ArchConfig
from dabba.layers.embedding import LMHead
from dabba.models import loader
from dabba.arch.checkpoint_names import checkpoint_target
from dabba.models.registry import get_model_class
from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.config import QuantConfig


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None and not isinstance(m.quant_method, UnquantizedLinearMethod)}


def complete_at(path: Path, arch: ArchConfig) -> dict[str, int]:
    """Module name -> position, in the loader's reading order, of the last tensor that fills it
    (a tied LM head is filled by the embedding's tensor)."""
    last: dict[str, int] = {}
    for i, (name, _) in enumerate(loader.iterate_weights(loader.find_weight_files(path))):
        module = checkpoint_target(name)[0].rsplit(".", 1)[0]
        last[module] = i
        if module == "model.embed_tokens" and arch.tie_word_embeddings:
            last["lm_head"] = i
    return last


def build(arch: ArchConfig, quant_config: QuantConfig) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return get_model_class(arch.architecture)(arch, 64, quant_config)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])  # untied; tied with q/k/v bias; fused qkv and gate_up
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_layer_is_quantized_and_freed_before_later_tensors_are_read(checkpoints, monkeypatch, name,
                                                                          method) -> None:
    path = checkpoints[name].path
    arch = ArchConfig.from_hf(path)
    last = complete_at(path, arch)
    seen: dict = {}

    class Spy(loader.LayerwiseRepacking):
        """Records the model's quantized modules and weak references to their bf16 weights."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__(model)
            seen["modules"] = quantized_modules(model)
            seen["weights"] = {m: weakref.ref(module.weight) for m, module in seen["modules"].items()
                               if not (m == "lm_head" and arch.tie_word_embeddings)}  # tied: the embedding's
            seen["checked"] = set()

    def spy_iterate(files: list[Path]):
        for i, (tensor_name, tensor) in enumerate(real_iterate(files)):
            for m, module in seen["modules"].items():
                if last[m] < i:
                    assert module.weight is None and module.qweight is not None, f"{m} not quantized at {tensor_name}"
                    assert m not in seen["weights"] or seen["weights"][m]() is None, \
                        f"{m}'s bf16 weight still alive when {tensor_name} is read"
                    seen["checked"].add(m)
            yield tensor_name, tensor

    real_iterate = loader.iterate_weights
    monkeypatch.setattr(loader, "LayerwiseRepacking", Spy)
    monkeypatch.setattr(loader, "iterate_weights", spy_iterate)
    model = loader.load_model(path, arch, torch.bfloat16, torch.device("cpu"), 64, QuantConfig(method))
    assert all(module.weight is None for module in quantized_modules(model).values())
    layer0 = {m for m in seen["modules"] if m.startswith("model.layers.0.")}
    assert len(layer0) == 4 and layer0 <= seen["checked"], "layer 0 was not checked before later tensors"


@pytest.mark.parametrize("name", ["qwen2", "phi3", "gemma3"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_streamed_repacking_equals_repacking_after_the_load(checkpoints, name, method) -> None:
    path = checkpoints[name].path
    arch = ArchConfig.from_hf(path)
    streamed = loader.load_model(path, arch, torch.bfloat16, torch.device("cpu"), 64, QuantConfig(method))
    at_end = build(arch, QuantConfig(method))  # the loader before streaming: every layer after the last tensor
    at_end.load_weights(loader.iterate_weights(loader.find_weight_files(path)))
    for module in list(at_end.modules()):
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
            if isinstance(module, LMHead):
                module.packed()  # a tied embedding takes the head's INT8 rows
    expected = {**dict(at_end.named_parameters()), **dict(at_end.named_buffers())}
    got = {**dict(streamed.named_parameters()), **dict(streamed.named_buffers())}
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_missing_tensor_still_fails_loudly_when_quantizing(checkpoints, tmp_path) -> None:
    path = Path(shutil.copytree(checkpoints["llama"].path, tmp_path / "ck"))
    state = load_file(path / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.qkv_proj\.weight#k"):
        LLM(str(path), quantization="int8")


def test_tensor_arriving_after_its_layer_was_repacked_is_refused(checkpoints) -> None:
    path = checkpoints["llama"].path
    arch = ArchConfig.from_hf(path)
    model = build(arch, QuantConfig("int8"))
    repack = loader.LayerwiseRepacking(model)
    tensors = list(loader.iterate_weights(loader.find_weight_files(path)))
    again = next(t for t in tensors if t[0] == "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"down_proj\.weight: arrived after .*down_proj was complete"):
        model.load_weights(itertools.chain(tensors, [again]), on_loaded=repack.loaded)


def file_rss_bytes(path: Path) -> int:
    """Resident bytes of every mapping of ``path`` in this process."""
    total, in_file = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[:1].isupper():  # a mapping's header line
                in_file = line.rstrip().endswith(str(path))
            elif in_file and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_weights_are_read_a_window_at_a_time(tmp_path, monkeypatch) -> None:
    """Only the window being read stays mapped: the file's resident pages stay near one window,
    not the whole file (a file held open kept every page read)."""
    mib = 2**20
    tensors = {f"t{i}": torch.full((mib // 4,), float(i)) for i in range(8)}  # 1 MiB each
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    monkeypatch.setattr(loader, "MAPPED_BYTES", mib)
    read = {}
    for name, tensor in loader.iterate_weights([file]):
        read[name] = tensor.clone()
        assert file_rss_bytes(file) <= 1.5 * mib, f"{file_rss_bytes(file)} bytes of the file resident at {name}"
    del tensor
    assert read.keys() == tensors.keys() and all(torch.equal(read[k], v) for k, v in tensors.items())
    assert file_rss_bytes(file) == 0
