"""LoRA adapters per request against PEFT on a tiny random Llama: three adapters (ranks 4, 8 and
rsLoRA 16 over different target modules) and the base model in one batch, greedy tokens equal to
PEFT's model with each adapter, and to the merged model's; two slots for three adapters (the
scheduler holds one back, the worker swaps slots); chunked prefill and preemption; the prefix
cache never shares blocks between adapters; bad adapters refused naming lora_request."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dabba import LLM, LoRARequest, SamplingParams
from tests.conftest import Checkpoint, hf_greedy

NUM_NEW = 12
ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "attn": (4, 8, ["q_proj", "v_proj"], False),
    "mlp": (8, 16, ["gate_proj", "down_proj", "o_proj"], False),
    "all": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


@pytest.fixture(scope="module")
def llama(checkpoints) -> Checkpoint:
    return checkpoints["llama"]


def make_adapter(base: Path, out: Path, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool):
    """A PEFT adapter with random A and B (PEFT starts B at zero: no change to learn from)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, tuple[LoRARequest, list[list[int]]]]:
    """Each adapter's request and PEFT's greedy tokens for the first 4 prompts."""
    out = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = tmp_path_factory.mktemp(f"lora_{name}")
        peft_model = make_adapter(llama.path, path, i, rank, alpha, targets, rslora)
        out[name] = (LoRARequest(name, i + 1, str(path)), hf_greedy(peft_model, llama.prompts[:4], NUM_NEW))
        if name == "all":  # the merged model, for the equality below
            merged = tmp_path_factory.mktemp("merged")
            peft_model.merge_and_unload().save_pretrained(merged)
            for f in llama.path.iterdir():
                if f.name.startswith("tokenizer") or f.name == "generation_config.json":
                    shutil.copy(f, merged / f.name)
            out["merged"] = (LoRARequest("merged", 99, str(merged)), [])
    return out


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(str(llama.path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
               max_num_batched_tokens=64)


def test_a_batch_of_three_adapters_and_the_base_equals_peft(llm, llama, adapters) -> None:
    """12 requests: each of 4 prompts with each adapter and with none, in one generate call;
    2 slots for 3 adapters and 64-token steps (the prompts are chunked)."""
    prompts, loras, want = [], [], []
    for k in range(4):
        for name in ("attn", None, "mlp", "all"):
            prompts.append({"prompt_token_ids": llama.prompts[k]})
            loras.append(adapters[name][0] if name else None)
            want.append(adapters[name][1][k] if name else llama.reference[k][:NUM_NEW])
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_adapter_equals_merged_model(llm, llama, adapters) -> None:
    merged = LLM(adapters["merged"][0].lora_path, dtype="float32")
    prompts = [{"prompt_token_ids": p} for p in llama.prompts[4:7]]
    ours = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=adapters["all"][0])
    theirs = merged.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


def test_prefix_cache_keeps_adapters_apart(llm, llama, adapters) -> None:
    """A prompt cached under one adapter is no hit for another, nor for the base model; a repeat
    under the same adapter is."""
    prompt = {"prompt_token_ids": llama.prompts[8]}  # 150 tokens and more: whole blocks
    first = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=adapters["attn"][0])[0]
    again = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=adapters["attn"][0])[0]
    other = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=adapters["mlp"][0])[0]
    base = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert base.outputs[0].token_ids == llama.reference[8][:NUM_NEW]


def test_preempted_adapter_requests_resume_equal(llama, adapters) -> None:
    """A KV cache too small for every request at once: preempted requests recompute under their adapter."""
    block_bytes = 16 * 2 * 2 * 24 * 4 * 2  # 16 tokens, k and v, 2 kv heads of 24, float32, 2 layers
    llm = LLM(str(llama.path), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              kv_cache_memory=6 * block_bytes, enable_prefix_caching=False)
    names = ["attn", "mlp", "all", None] * 2
    outs = llm.generate([{"prompt_token_ids": llama.prompts[k % 4]} for k in range(8)], greedy(), use_tqdm=False,
                        lora_request=[adapters[n][0] if n else None for n in names])
    want = [adapters[n][1][k % 4] if n else llama.reference[k % 4][:NUM_NEW] for k, n in enumerate(names)]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_stats().num_preemptions > 0


def test_bad_adapters_refused(llm, llama, adapters, tmp_path) -> None:
    prompt = {"prompt_token_ids": llama.prompts[0]}

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match) as info:
            llm.generate(prompt, greedy(), use_tqdm=False, lora_request=lora)
        assert getattr(info.value, "param", "lora_request") == "lora_request"

    good = Path(adapters["attn"][0].lora_path)
    refused(LoRARequest("missing", 50, str(tmp_path / "nowhere")), "not a directory")
    wide = shutil.copytree(good, tmp_path / "wide")
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    refused(LoRARequest("wide", 51, str(wide)), "larger than max_lora_rank 16")
    broken = shutil.copytree(good, tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    refused(LoRARequest("broken", 52, str(broken)), "not a readable safetensors")
    dora = shutil.copytree(good, tmp_path / "dora")
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused(LoRARequest("dora", 53, str(dora)), "use_dora")
    # an adapter of another base model: a layer of another width
    from safetensors.torch import load_file, save_file
    other = shutil.copytree(good, tmp_path / "other")
    tensors = {k: (torch.zeros(v.shape[0], v.shape[1] + 8) if "lora_A" in k else v)
               for k, v in load_file(good / "adapter_model.safetensors").items()}
    save_file(tensors, other / "adapter_model.safetensors")
    refused(LoRARequest("other", 54, str(other)), "another base model")
    # the engine keeps serving
    out = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=adapters["attn"][0])[0]
    assert out.outputs[0].token_ids == adapters["attn"][1][0]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(llama.path), dtype="float32").generate(prompt, greedy(), use_tqdm=False,
                                                        lora_request=adapters["attn"][0])


def test_slot_swaps_read_each_adapter_once(llama, adapters, monkeypatch) -> None:
    """One slot, three adapters taking turns: each adapter's files are read once by the worker
    (parsed adapters stay in host memory), and the outputs still equal PEFT's."""
    from dabba.worker import lora_manager

    reads: list[str] = []
    real = lora_manager.read_peft_adapter
    monkeypatch.setattr(lora_manager, "read_peft_adapter", lambda path, rank: reads.append(path) or real(path, rank))
    llm = LLM(str(llama.path), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    for _ in range(2):
        for name in ("attn", "mlp", "all"):
            out = llm.generate({"prompt_token_ids": llama.prompts[1]}, greedy(), use_tqdm=False,
                               lora_request=adapters[name][0])[0]
            assert out.outputs[0].token_ids == adapters[name][1][1]
    assert sorted(reads) == sorted(adapters[n][0].lora_path for n in ("attn", "mlp", "all"))


def grid_checkpoint(base: Path, out: Path, bits: int, group_size: int | None, symmetric: bool) -> Path:
    """``base`` with every projection rounded to a quantizer's grid (its own codes' values), so that
    the quantized engine multiplies the very weights PEFT is given."""
    from safetensors.torch import load_file, save_file

    from dabba.quantization.rtn import quantize

    shutil.copytree(base, out, dirs_exist_ok=True)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            if w.dim() == 2 and "proj" in name:
                tensors[name] = quantize(w.float(), bits, group_size or w.shape[1], symmetric).dequantize().to(w.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("quantization, bits, group_size, symmetric", [
    ("int8", 8, None, True), ("w8a8", 8, None, True), ("int4", 4, 32, False)])
def test_adapters_on_quantized_base_weights(llama, tmp_path, quantization, bits, group_size, symmetric) -> None:
    """On INT8, W8A8 and INT4 bases (weights on the quantizer's grid), the log-probabilities of a
    sequence with an adapter stay as close to PEFT's on the same weights as the base model's stay to
    transformers' (the kernels' rounding, W8A8's of activations too: a near tie may flip a token,
    so tokens are not compared), far closer than the adapter moves them."""
    from transformers import AutoModelForCausalLM

    grid = grid_checkpoint(llama.path, tmp_path / "grid", bits, group_size, symmetric)
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    peft_model = make_adapter(grid, tmp_path / "adapter", 7, 8, 16, targets, False)
    sequence = llama.prompts[5] + llama.reference[5][:16]

    def reference(model) -> torch.Tensor:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0, :-1].float(), -1)
        return logprobs.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]

    want = reference(peft_model)
    want_base = reference(AutoModelForCausalLM.from_pretrained(grid, dtype=torch.float32))
    llm = LLM(str(grid), dtype="float32", quantization=quantization, enable_lora=True, max_lora_rank=8,
              max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(lora: LoRARequest | None) -> torch.Tensor:
        out = llm.generate({"prompt_token_ids": sequence}, params, use_tqdm=False, lora_request=lora)[0]
        return torch.tensor([p[t].logprob for p, t in zip(out.prompt_logprobs[1:], sequence[1:])])

    ours, base = prompt_logprobs(LoRARequest("a", 1, str(tmp_path / "adapter"))), prompt_logprobs(None)
    base_error = (base - want_base).abs().max()
    assert (ours - want).abs().max() < max(0.02, 2 * base_error)
    assert (ours - base).abs().max() > 10 * max(0.02, 2 * base_error)  # the adapter matters here
