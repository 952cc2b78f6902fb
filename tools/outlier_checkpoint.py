"""A copy of a Llama-family checkpoint whose activations carry outlier channels, as real LLMs' do,
for measuring what W8A8 loses to them and what SmoothQuant wins back.

Trained LLMs grow a few hidden channels whose values, after the RMSNorm, run 10-100x larger than
the rest in every token (Dettmers et al., 2022; Xiao et al., 2023). A small model trained briefly has
none. This puts them in without changing what the model computes: for a few channels c, each layer's
input_layernorm and post_attention_layernorm weights are multiplied by ``factor`` and the columns c of
the linears that read them (q, k, v; gate, up) divided by it. In full precision x W^T is the same (to
the dtype's rounding); a per-token activation scale is now set by those channels.

    python -m tools.outlier_checkpoint SRC DST [--channels 4] [--factor 30]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# each norm, and the linears that read its output
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def add_activation_outliers(src: str | Path, dst: str | Path, channels: int = 4, factor: float = 30.0,
                            seed: int = 0) -> list[int]:
    """Write the outlier copy of ``src`` (one model.safetensors, Llama's tensor names) to ``dst``;
    returns the outlier channels."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    hidden = int(config["hidden_size"])
    if not 0 < channels < hidden:
        raise ValueError(f"channels must be in [1, {hidden}), got {channels}")
    chosen = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))[:channels].sort().values
    tensors = load_file(src / "model.safetensors")
    layers = int(config["num_hidden_layers"])
    for i in range(layers):
        for norm, readers in READERS.items():
            name = f"model.layers.{i}.{norm}.weight"
            w = tensors[name].float()
            w[chosen] *= factor
            tensors[name] = w.to(tensors[name].dtype)
            for reader in readers:
                name = f"model.layers.{i}.{reader}.weight"
                w = tensors[name].float()
                w[:, chosen] /= factor
                tensors[name] = w.to(tensors[name].dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    return chosen.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--channels", type=int, default=4, help="how many outlier channels (default 4)")
    parser.add_argument("--factor", type=float, default=30.0, help="how much larger they run (default 30)")
    args = parser.parse_args()
    print(json.dumps({"channels": add_activation_outliers(args.src, args.dst, args.channels, args.factor)}))


if __name__ == "__main__":
    main()
