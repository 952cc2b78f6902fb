"""compressed-tensors W8A8 checkpoints (llm-compressor's format, as vLLM loads it), checked against
the compressed-tensors package itself: it parses and dequantizes what `dabba quantize --method w8a8`
writes, its own compressor writes the same tensors for the same weights, and what it writes (dynamic
and static, symmetric and asymmetric activations, per-channel and per-tensor weight scales, an
ignore list) loads in dabba and computes what a PyTorch reference computes from the package's own
reading of the file with the same activation rounding (w8a8.w8a8_reference)."""
from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from dabba import LLM, SamplingParams
from dabba.arch.checkpoint_names import shard_checkpoint_names
from dabba.config import DEMO_MODEL
from dabba.entrypoints.cli import main
from dabba.models.sizes import weights_bytes
from dabba.quantization import compressed_tensors as ct
from dabba.quantization import compressed_tensors_writer as ct_writer
from dabba.quantization.base import UnquantizedLinearMethod
from dabba.quantization.config import QuantConfig
from dabba.quantization.w8a8 import w8a8_reference
from tests.conftest import make_prompts, token_prompts
from tests.distributed import test_tensor_parallel
from tools.tiny_checkpoint import make_checkpoint

threaded = test_tensor_parallel.threaded  # LLM(tensor_parallel_size=2) runs its ranks as threads here

NEW_TOKENS = 8
MARGIN = 0.25  # nats: see assert_greedy_as_reference
MEAN_DIFF = 0.03
# (weights strategy, static activations, asymmetric activations)
SCHEMES = {"dynamic": ("channel", False, False), "dynamic-asym": ("channel", False, True),
           "static": ("channel", True, False), "static-asym": ("channel", True, True),
           "tensor-static": ("tensor", True, False)}


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.model_runner.model


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Tiny random float32 checkpoints: Llama, and Qwen2 (q/k/v biases)."""
    out = tmp_path_factory.mktemp("ct-sources")
    return {"llama": make_checkpoint(out / "llama", "LlamaForCausalLM", initializer_range=0.1),
            "qwen2": make_checkpoint(out / "qwen2", "Qwen2ForCausalLM", initializer_range=0.1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=24)}


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ct-calibration") / "calib.txt"
    path.write_text(open(f"{DEMO_MODEL}/calibration.txt").read()[:20_000])
    return path


def package_scheme(weights: str, static: bool, asymmetric: bool) -> QuantizationScheme:
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy=weights),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=not asymmetric, dynamic=not static,
                                           strategy="tensor" if static else "token"))


def package_checkpoint(src: Path, out: Path, scheme: QuantizationScheme, ignore: list[str]) -> Path:
    """``src`` quantized and saved by compressed-tensors itself, as llm-compressor drives it: the
    scheme applied, weight scales and zero points from its calculate_qparams over each weight's
    range (llm-compressor's minmax weight observer), static activation scales from the range each
    linear's input took over random token ids (its static_minmax observer), then its compressor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore),
                              show_progress=False)
    modules = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        lo, hi = x.amin().reshape(1), x.amax().reshape(1)
        old = ranges.get(name, (lo, hi))
        ranges[name] = (torch.minimum(old[0], lo), torch.maximum(old[1], hi))
    hooks = [m.register_forward_pre_hook(lambda _, args, n=n: observe(n, args[0])) for n, m in modules.items()]
    for m in modules.values():
        m.quantization_enabled = False  # calibrate in full precision
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)))
    for hook in hooks:
        hook.remove()
    for name, m in modules.items():
        w = m.weight.data
        lo, hi = (w.amin(1, keepdim=True), w.amax(1, keepdim=True)) if m.weight_scale.numel() > 1 else \
            (w.amin().reshape(1), w.amax().reshape(1))
        scale, zero = calculate_qparams(lo, hi, scheme.weights)
        m.weight_scale.data.copy_(scale)
        m.weight_zero_point.data.copy_(zero)
        if not scheme.input_activations.dynamic:
            scale, zero = calculate_qparams(*ranges[name], scheme.input_activations)
            m.input_scale.data.copy_(scale)
            m.input_zero_point.data.copy_(zero)
        m.quantization_enabled = True
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja", ".txt") and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    return out


def w8a8_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A compressed module as the package loaded it (int8 weight, weight_scale, input_scale,
    input_zero_point), computed as dabba's W8A8 reference computes it."""
    args = module.quantization_scheme.input_activations
    static = not args.dynamic
    scales = module.weight_scale.float().reshape(-1).expand(module.weight.shape[0])
    zero = getattr(module, "input_zero_point", None)
    y = w8a8_reference(x.reshape(-1, x.shape[-1]), module.weight, scales, module.bias, not args.symmetric,
                       module.input_scale.float().reshape(1) if static else None,
                       zero.to(torch.int32).reshape(1) if static and zero is not None else None)
    return y.view(*x.shape[:-1], -1)


def reference_model(path: Path) -> torch.nn.Module:
    """transformers + compressed-tensors' own reading of the checkpoint (its modules keep the
    file's codes and scales), each quantized linear computed by w8a8_reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if hasattr(model, "ct_decompress_hook"):  # it would dequantize the codes at the first forward
        model.ct_decompress_hook.remove()
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            assert module.weight.dtype == torch.int8
            module.forward = functools.partial(w8a8_forward, module)
    return model


def assert_layers_as_reference(llm: LLM, reference: torch.nn.Module) -> int:
    """Every linear of every decoder layer gives, bit for bit, what the reference's modules give
    for it (a merged layer: its shards' outputs side by side) on the same inputs; the number of
    quantized layers. Exact: both round the same inputs the same way (an ignored layer: float32
    GEMMs, to within their rounding)."""
    quantized = 0
    g = torch.Generator().manual_seed(0)
    for name, layer in model_of(llm).named_modules():
        method = getattr(layer, "quant_method", None)
        if not name.startswith("model.layers") or not isinstance(method, (ct.CompressedTensorsW8A8Method,
                                                                          UnquantizedLinearMethod)):
            continue
        x = torch.randn(5, layer.in_features, generator=g) * 3
        shards = shard_checkpoint_names(name, layer.shard_ids) if layer.shard_ids else [name]
        with torch.no_grad():
            want = torch.cat([reference.get_submodule(s)(x) for s in shards], dim=-1)
            got = layer(x)
        if isinstance(layer.quant_method, UnquantizedLinearMethod):
            assert torch.allclose(got, want, atol=1e-5), name
        else:
            assert torch.equal(got, want), name
            quantized += 1
    return quantized


def assert_greedy_as_reference(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    """The same linears (assert_layers_as_reference), and through the whole model dabba's greedy
    tokens are the reference's likeliest wherever its top two lie more than MARGIN apart, each
    chosen token's logprob within MARGIN of the reference's and on average within MEAN_DIFF. Not
    closer: attention and norms differ in float32 rounding (3e-6 nats between the two in full
    precision), and a difference of 1e-6 moves an activation that lies near a rounding boundary
    to the next code: perturbing these tiny models' embeddings by 1e-6 (relative) moved the
    likeliest token's logprob by up to 0.083 nats over 60 prompts, its lead over the second by
    up to 0.09, and a prompt's mean by up to 0.016."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    reference = reference_model(path)
    assert assert_layers_as_reference(llm, reference) > 0
    diffs = []
    for prompt, out in zip(prompts, llm.generate(token_prompts(prompts), params, use_tqdm=False)):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        for t, token in enumerate(tokens):
            top = ref[t].topk(2)
            if top.values[0] - top.values[1] > MARGIN:
                assert token == top.indices[0].item(), (prompt, t)
            diffs.append(abs(out.outputs[0].logprobs[t][token].logprob - ref[t, token].item()))
    assert max(diffs) < MARGIN and sum(diffs) / len(diffs) < MEAN_DIFF, diffs


def prompts_for(path: Path) -> list[list[int]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return [make_prompts(vocab)[i] for i in (0, 2, 5, 7)]  # 1, 7, 33 and 100 tokens


def dabba_quantize(src: Path, out: Path, calibration: Path, *flags: str) -> Path:
    assert main(["quantize", str(src), str(out), "--method", "w8a8", "--calibration", str(calibration),
                 "--num-samples", "4", "--seq-len", "64", *flags]) == 0
    return out


# --- what dabba writes, read by the package ------------------------------------------------------------------------


def test_dabba_writes_the_packages_own_tensors(sources, tmp_path) -> None:
    """Dynamic W8A8: `dabba quantize` and the package's compressor write the same int8 codes and
    float32 scales for every linear (dabba's INT8 rounding is compressed-tensors' minmax: s = 2
    max|w| / 255), and the package parses dabba's config into the scheme it wrote itself."""
    ours = dabba_quantize(sources["llama"], tmp_path / "ours", Path(DEMO_MODEL) / "calibration.txt")
    theirs = package_checkpoint(sources["llama"], tmp_path / "theirs", package_scheme("channel", False, False),
                                ["lm_head"])
    a, b = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert a.keys() == b.keys()
    assert sum(t.dtype == torch.int8 for t in a.values()) == 14  # 7 linears x 2 layers
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    config = json.loads((ours / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    own = QuantizationConfig.model_validate(json.loads((theirs / "config.json").read_text())["quantization_config"])
    assert parsed.config_groups["group_0"].model_dump() == own.config_groups["group_0"].model_dump()
    assert parsed.ignore == own.ignore == ["lm_head"] and parsed.format == "int-quantized"


@pytest.mark.parametrize("asymmetric", [False, True])
def test_the_package_reads_dabbas_static_checkpoint(sources, calibration, tmp_path, asymmetric) -> None:
    """Static activations: the package's QuantizationConfig parses the config; its decompression
    (transformers' compressed-tensors loader, dequantize=True) gives codes x weight_scale for every
    linear; its compressed reading holds dabba's input_scale (and input_zero_point)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    flags = ["--activations", "static"] + (["--asymmetric-activations"] if asymmetric else [])
    path = dabba_quantize(sources["qwen2"], tmp_path / "q", calibration, *flags)
    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    inputs = config.config_groups["group_0"].input_activations
    assert (inputs.dynamic, inputs.strategy, inputs.symmetric) == (False, "tensor", not asymmetric)
    tensors = load_file(path / "model.safetensors")
    dequantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                       quantization_config=CompressedTensorsConfig(dequantize=True))
    compressed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    checked = 0
    for name, module in dequantized.named_modules():
        if f"{name}.weight_scale" not in tensors:
            continue
        codes, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        assert codes.dtype == torch.int8 and scale.shape == (codes.shape[0], 1)
        assert torch.equal(module.weight.data, codes.float() * scale), name
        stored = compressed.get_submodule(name)
        assert torch.equal(stored.input_scale.data, tensors[f"{name}.input_scale"])
        assert hasattr(stored, "input_zero_point") == asymmetric == (f"{name}.input_zero_point" in tensors)
        checked += 1
    assert checked == 14
    # q/k/v share their input, hence its range and scale
    layer = "model.layers.1.self_attn"
    assert torch.equal(tensors[f"{layer}.q_proj.input_scale"], tensors[f"{layer}.v_proj.input_scale"])


def test_static_scales_are_the_packages_qparams() -> None:
    """ActivationRange.qparams is compressed-tensors' calculate_qparams (what llm-compressor's
    static_minmax observer yields), bit for bit, symmetric and asymmetric, ranges that straddle 0
    or not."""
    g = torch.Generator().manual_seed(0)
    for lo, hi in [(-3.0, 5.0), (0.25, 7.5), (-9.0, -0.5)] + [tuple(sorted(torch.randn(2, generator=g).mul(4).tolist()))
                                                              for _ in range(20)]:
        observed = ct_writer.ActivationRange()
        observed.observe(torch.tensor([[lo, hi]]))
        for asymmetric in (False, True):
            args = QuantizationArgs(num_bits=8, symmetric=not asymmetric, strategy="tensor")
            scale, zero = calculate_qparams(torch.tensor([lo]), torch.tensor([hi]), args)
            ours, our_zero = observed.qparams(asymmetric)
            assert torch.equal(ours, scale), (lo, hi, asymmetric)
            assert torch.equal(our_zero if asymmetric else torch.zeros(1, dtype=torch.int8), zero), (lo, hi)


# --- what the package writes, read by dabba -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_dabba_computes_the_packages_checkpoints(sources, tmp_path, name) -> None:
    weights, static, asymmetric = SCHEMES[name]
    path = package_checkpoint(sources["llama"], tmp_path / name, package_scheme(weights, static, asymmetric),
                              ["lm_head"])
    llm = LLM(str(path), dtype="float32")
    layer = model_of(llm).model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_method, ct.CompressedTensorsW8A8Method)
    assert layer.quant_method.scheme == ct.W8A8Scheme(weights, static, asymmetric)
    assert_greedy_as_reference(llm, path, prompts_for(path))
    planned = weights_bytes(llm.llm_engine.resolved.arch, torch.float32, llm.llm_engine.resolved.quant_config, "cpu")
    assert planned == llm.llm_engine.engine_core.model_runner.weight_bytes  # the planner counts what loading holds


def test_dabba_computes_its_own_checkpoints(sources, calibration, tmp_path) -> None:
    """Written by `dabba quantize` (Qwen2: q/k/v biases copied beside the codes), read back by the
    package's loader for the reference; the codes of a dynamic checkpoint are load-time w8a8's."""
    static = dabba_quantize(sources["qwen2"], tmp_path / "static", calibration, "--activations", "static")
    assert_greedy_as_reference(LLM(str(static), dtype="float32"), static, prompts_for(static))
    dynamic = dabba_quantize(sources["llama"], tmp_path / "dyn", calibration, "--asymmetric-activations")
    llm = LLM(str(dynamic), dtype="float32")
    assert_greedy_as_reference(llm, dynamic, prompts_for(dynamic))
    # its layers run in the native loop (asymmetric rounding there too), bit for bit the Python layers'
    assert llm.llm_engine.engine_core.model_runner.native_loop is not None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = token_prompts(prompts_for(dynamic))
    python = LLM(str(dynamic), dtype="float32", native_layer_loop="off").generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)] \
        == [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in python]
    load_time = model_of(LLM(str(sources["llama"]), dtype="float32", quantization="w8a8"))
    for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours = model_of(llm).get_submodule(f"model.layers.1.{layer}")
        theirs = load_time.get_submodule(f"model.layers.1.{layer}")
        assert torch.equal(ours.quant_method.codes(ours), theirs.quant_method.codes(theirs)), layer
        assert torch.equal(ours.w8a8_scales, theirs.w8a8_scales), layer


def test_ignored_layers_stay_in_full_precision(sources, tmp_path) -> None:
    """An exact name per shard and a regex: those layers load their float weights unquantized, the
    rest their codes, and the model computes the package's reading of it."""
    ignore = ["lm_head", "re:.*down_proj$"] + [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    path = package_checkpoint(sources["llama"], tmp_path / "ignore", package_scheme("channel", True, True), ignore)
    assert load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    llm = LLM(str(path), dtype="float32")
    methods = {name: type(m.quant_method) for name, m in model_of(llm).named_modules() if hasattr(m, "quant_method")
               and name.startswith("model.layers")}
    unquantized = {n for n, t in methods.items() if t is UnquantizedLinearMethod}
    assert unquantized == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                           "model.layers.1.self_attn.qkv_proj"}
    assert len(methods) - len(unquantized) == 5
    assert_greedy_as_reference(llm, path, prompts_for(path))


def test_merged_shards_with_their_own_static_scales(sources, tmp_path) -> None:
    """q/k/v (gate/up) each carry an input_scale; dabba's one layer takes vLLM's merge: the largest
    scale (symmetric), the range covering every shard's (asymmetric)."""
    for asymmetric in (False, True):
        path = package_checkpoint(sources["llama"], tmp_path / f"merge{asymmetric}",
                                  package_scheme("channel", True, asymmetric), ["lm_head"])
        tensors = load_file(path / "model.safetensors")
        prefix = "model.layers.0.self_attn"
        tensors[f"{prefix}.k_proj.input_scale"] = tensors[f"{prefix}.q_proj.input_scale"] * 2
        if asymmetric:
            tensors[f"{prefix}.v_proj.input_zero_point"] = torch.tensor([-40], dtype=torch.int8)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        layer = model_of(LLM(str(path), dtype="float32")).model.layers[0].self_attn.qkv_proj
        s = torch.cat([tensors[f"{prefix}.{p}_proj.input_scale"] for p in "qkv"]).float()
        if not asymmetric:
            assert torch.equal(layer.w8a8_input_scale, s.max().reshape(1)) and layer.w8a8_input_zero.item() == 0
            continue
        zp = torch.cat([tensors[f"{prefix}.{p}_proj.input_zero_point"] for p in "qkv"]).int()
        lo, hi = (s * (-128 - zp)).min(), (s * (127 - zp)).max()  # vLLM: the range every shard covers
        assert torch.equal(layer.w8a8_input_scale, ((hi - lo) / 255).reshape(1))
        assert layer.w8a8_input_zero.item() == round((-128 - lo / ((hi - lo) / 255)).item())


def test_merge_keeps_agreeing_shards_as_stored() -> None:
    scales, zeros = torch.tensor([0.1, 0.1, 0.1]), torch.tensor([3, 3, 3], dtype=torch.int32)
    assert ct.merge_input_qparams(scales, zeros) == (scales[:1], zeros[:1])
    scale, zero = ct.merge_input_qparams(torch.tensor([0.1, 0.3]), None)
    assert torch.equal(scale, torch.tensor([0.3])) and zero is None


@pytest.mark.parametrize("name", ["dynamic-asym", "static-asym"])
def test_tp2_matches_tp1(sources, tmp_path, threaded, name) -> None:
    """Column-parallel shards keep their rows' codes and scales, row-parallel ones their inputs'
    codes with the whole row's scales as stored; a static activation scale and zero point are every
    rank's, and dynamic rows are rounded by the whole row's range (W8A8Method.whole_row_range): the
    ranks' integer sums add up to the whole layer's."""
    path = package_checkpoint(sources["llama"], tmp_path / "tp", package_scheme(*SCHEMES[name]), ["lm_head"])
    prompts = token_prompts(prompts_for(path))
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    whole = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32").generate(prompts, greedy, use_tqdm=False)]
    split = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in split.generate(prompts, greedy, use_tqdm=False)] == whole
    assert threaded[0].group.calls > 0


# --- what dabba refuses ---------------------------------------------------------------------------------------------


def valid_config() -> dict:
    """What llm-compressor writes for W8A8 (the package's own serialisation)."""
    config = QuantizationConfig(config_groups={"group_0": package_scheme("channel", True, True)}, ignore=["lm_head"],
                                format="int-quantized", quantization_status="compressed").model_dump()
    return json.loads(json.dumps(config, default=str))


def test_the_packages_configs_parse() -> None:
    for name, (weights, static, asymmetric) in SCHEMES.items():
        config = valid_config()
        config["config_groups"] = {"group_0": json.loads(package_scheme(weights, static, asymmetric).model_dump_json())}
        parsed = QuantConfig.from_checkpoint(config).compressed_tensors
        assert parsed.scheme_of("model.layers.3.mlp.up_proj") == ct.W8A8Scheme(weights, static, asymmetric), name
        assert parsed.scheme_of("lm_head") is None
    config = valid_config()
    config["config_groups"] = {"W8A8": ["Linear"]}  # a preset by name
    config["format"] = "naive-quantized"  # the package's older name of int8 storage
    assert QuantConfig.from_checkpoint(config).compressed_tensors.scheme_of("model.layers.0.mlp.down_proj") == \
        ct.W8A8Scheme("channel", static=False, asymmetric=False)


def group(config: dict) -> dict:
    return config["config_groups"]["group_0"]


REFUSED = {
    "weights.symmetric": lambda c: group(c)["weights"].update(symmetric=False),
    "weights.group_size": lambda c: group(c)["weights"].update(strategy="group", group_size=128),
    "weights.num_bits": lambda c: group(c)["weights"].update(num_bits=4),
    "weights.type": lambda c: group(c)["weights"].update(type="float"),
    "weights.block_structure": lambda c: group(c)["weights"].update(strategy="block", block_structure=[128, 128]),
    "weights.observers": lambda c: group(c)["weights"].update(observers="minmax"),
    "quantization_config.format": lambda c: c.update(format="pack-quantized"),
    "group_0.format": lambda c: group(c).update(format="float-quantized"),
    "output_activations": lambda c: group(c).update(output_activations=group(c)["weights"]),
    "kv_cache_scheme": lambda c: c.update(kv_cache_scheme=group(c)["input_activations"]),
    "sparsity_config": lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}),
    "quantization_status": lambda c: c.update(quantization_status="frozen"),
    "input_activations: dynamic True with strategy 'tensor'": lambda c: group(c)["input_activations"].update(
        dynamic=True),
    "input_activations: dynamic 'local'": lambda c: group(c)["input_activations"].update(dynamic="local"),
    "input_activations.num_bits": lambda c: group(c)["input_activations"].update(num_bits=4),
    "group_0.input_activations: weight-only": lambda c: group(c).update(input_activations=None),
    "group_0.targets: 'Embedding'": lambda c: group(c).update(targets=["Linear", "Embedding"]),
    "quantization_config.ignore: 'lm_head'": lambda c: c.update(ignore=[]),
    "config_groups.W4A16: preset": lambda c: c.update(config_groups={"W4A16": ["Linear"]}),
    "quantization_config.ignore: 're:(' is not a valid": lambda c: c.update(ignore=["lm_head", "re:("]),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(field) -> None:
    config = copy.deepcopy(valid_config())
    REFUSED[field](config)
    with pytest.raises(ValueError, match=re.escape(field.split(":")[0])):
        QuantConfig.from_checkpoint(config)


def test_shards_quantized_differently_are_refused(sources, tmp_path) -> None:
    path = package_checkpoint(sources["llama"], tmp_path / "half", package_scheme("channel", False, False),
                              ["lm_head", "model.layers.0.self_attn.q_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj's shards"):
        LLM(str(path), dtype="float32")


def test_quantize_refuses_what_w8a8_does_not_write(sources, tmp_path, capsys) -> None:
    assert main(["quantize", str(sources["llama"]), str(tmp_path / "q"), "--method", "w8a8", "--bits", "4"]) == 2
    assert "error: bits" in capsys.readouterr().err
    assert main(["quantize", str(sources["llama"]), str(tmp_path / "q"), "--method", "gptq", "--activations",
                 "static", "--calibration", f"{DEMO_MODEL}/calibration.txt"]) == 2
    assert "error: activations" in capsys.readouterr().err
