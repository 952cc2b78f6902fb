"""The peer side of test_peer_gptqmodel.py: GPTQModel (an independent GPTQ/AWQ implementation),
run with the peer venv's python (.venv-gptqmodel/, made by scripts/peer-gptqmodel.sh), never
imported by dabba or by its tests' own interpreter.

    python peer_gptqmodel.py write SRC OUT gptq|awq [CALIBRATION_TXT]
        GPTQModel quantizes the Hugging Face checkpoint SRC on CPU (4 bits, group 128; GPTQ
        symmetric without act-order, or AWQ gemm with zero points) and saves it to OUT.
    python peer_gptqmodel.py logprobs CKPT TOKENS_JSON OUT_PT
        GPTQModel loads the quantized checkpoint CKPT with its portable torch kernels on CPU and
        saves, for each token-id sequence in TOKENS_JSON (a list of lists), the float32
        log-softmax of its logits, a [len, vocab] tensor, as a list with torch.save.

The logprobs are computed in float32 throughout, so that another implementation's result can be
compared tightly: GPTQModel loads in fp16/bf16 only, so after loading, every floating tensor is
cast back to float32 and reloaded from the checkpoint's exact values (scales included), RoPE's
inv_freq is recomputed in float32, and AWQ layers (whose torch kernel always computes in
fp16/bf16) dequantize with GPTQModel's own AWQ unpacking code but multiply in float32.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import torch


def write(src: str, out: str, method: str, calibration: str | None = None) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    text = open(calibration or os.path.join(src, "calibration.txt"), encoding="utf-8").read()
    calib = [text[i:i + 1000] for i in range(0, len(text), 1000)][:16]
    if method == "gptq":
        qc = QuantizeConfig(bits=4, group_size=128, sym=True, desc_act=False)
    elif method == "awq":
        from gptqmodel.quantization import FORMAT, METHOD

        qc = QuantizeConfig(bits=4, group_size=128, quant_method=METHOD.AWQ, format=FORMAT.GEMM, sym=False)
    else:
        raise SystemExit(f"unknown method {method!r}: gptq or awq")
    model = GPTQModel.load(src, qc, device="cpu")
    model.quantize(calib, batch_size=4)
    model.save(out)


def _checkpoint_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for fn in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        tensors.update(load_file(fn))
    return tensors


def _awq_forward_fp32(module):
    """AwqTorchLinear.forward with its own dequantization but a float32 matmul."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits, module.group_size)
        out = torch.matmul(x.float(), w.float())
        if module.bias is not None:
            out = out + module.bias.float()
        return out

    return forward


def load_fp32(ckpt: str):
    from gptqmodel import BACKEND, GPTQModel

    peer = GPTQModel.load(ckpt, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    model = peer.model
    torch.nn.Module.float(model)  # HF's .float() refuses quantized models; the kernels run fp32 inputs
    # Put back the checkpoint's exact values: the fp16 load rounded bf16 weights and bf16 AWQ scales.
    tensors = _checkpoint_tensors(ckpt)
    state = model.state_dict()
    exact = {k: v.float() for k, v in tensors.items() if k in state and v.is_floating_point()}
    assert any(k.endswith(".scales") for k in exact), "no quantized layer found in the checkpoint"
    with torch.no_grad():
        for k, v in exact.items():
            assert state[k].shape == v.shape, (k, state[k].shape, v.shape)
            state[k].copy_(v)
    # RoPE's inv_freq went through fp16 too: recompute it in float32 from the config.
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    assert rotaries, "no rotary embedding found"
    for module in rotaries:
        fresh = type(module)(module.config)  # computes inv_freq in float32 on the CPU
        with torch.no_grad():
            module.inv_freq.copy_(fresh.inv_freq)
            if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                module.original_inv_freq.copy_(fresh.original_inv_freq)
    kinds = set()
    for module in model.modules():
        kind = type(module).__name__
        if kind == "AwqTorchLinear":
            module.forward = _awq_forward_fp32(module)
        if hasattr(module, "qweight"):
            kinds.add(kind)
    print("peer quantized layers:", sorted(kinds), file=sys.stderr)
    return model.eval()


def logprobs(ckpt: str, tokens_json: str, out: str) -> None:
    model = load_fp32(ckpt)
    sequences = json.load(open(tokens_json))
    result = []
    with torch.inference_mode():
        for ids in sequences:
            logits = model(torch.tensor([ids])).logits[0]
            assert logits.dtype == torch.float32, logits.dtype
            result.append(logits.log_softmax(-1))
    torch.save(result, out)


def main(argv: list[str]) -> None:
    if len(argv) >= 4 and argv[0] == "write":
        write(*argv[1:5])
    elif len(argv) == 4 and argv[0] == "logprobs":
        logprobs(*argv[1:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
