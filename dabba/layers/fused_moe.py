"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a router picks each token's top-k experts,
and only the experts some token picked are read and multiplied.

Each expert is a gated MLP of its own, two ``Linear`` layers: ``experts.{e}.gate_up_proj`` (its
gate rows, then its up rows, the dense MLP's merged layout) and ``experts.{e}.down_proj``. Held
per expert, every linear method applies to them unchanged (load-time INT8/INT4, GPTQ and AWQ
checkpoints, layer-by-layer repacking while loading, the planner's byte counts), and each is one
``NativeLinearSpec`` to the native kernels. Checkpoints store the experts per expert
(``experts.{e}.gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w3``/``w2``) or stacked
(transformers 5's ``experts.gate_up_proj`` [experts, 2 * intermediate, hidden] and
``experts.down_proj``); dabba.models.moe maps either onto these layers.

The forward pass follows transformers' routing exactly: softmax over the router's logits in
float32, torch.topk (the same ties), renormalised over the k where the family does; then tokens
grouped by expert, one gate_up and one down projection per expert that some token chose, over its
tokens, each result scaled by its routing weight and added into the token's row in ascending
expert order (as transformers' loop adds them). The Python loop runs over the chosen experts only.
"""
from __future__ import annotations

import torch
from torch import nn

from dabba.arch.config import MoEConfig
from dabba.distributed.tensor_parallel import current_tensor_parallel
from dabba.layers.linear import Linear
from dabba.layers.native_form import NativeMLP
from dabba.quantization.config import QuantConfig


def route(router_logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k routing weights [tokens, k], expert ids [tokens, k]) as transformers computes them."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.weights_in_model_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, experts


class Expert(nn.Module):
    """down(act(gate) * up), as the dense LlamaMLP, at the expert's intermediate size."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, prefix: str,
                 quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], shard_ids=(0, 1),
                                   prefix=f"{prefix}.gate_up_proj", quant_config=quant_config, parallel="column")
        # FusedMoE sums the ranks' partial results once, over all experts
        self.down_proj = Linear(intermediate_size, [hidden_size], prefix=f"{prefix}.down_proj", quant_config=quant_config,
                                parallel="row", reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, act_and_mul=self.activation))


def moe_forward(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(x), calling only the experts chosen."""
    top_k = chosen.shape[1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    flat_weights = weights.flatten()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        y = experts[e](x[tokens]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """Router + experts. ``prefix``: the block's checkpoint name (dabba's ``mlp``). The router stays
    unquantized whatever the quantization (a few thousand weights a layer, and it decides which
    experts run at all); the experts take ``quant_config``."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, activation: str, prefix: str,
                 quant_config: QuantConfig | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = current_tensor_parallel()  # every rank routes every token, and holds its part of every expert
        self.gate = Linear(hidden_size, [cfg.num_experts], prefix=f"{prefix}.gate")
        self.experts = nn.ModuleList(
            Expert(hidden_size, cfg.intermediate_size, activation, f"{prefix}.experts.{e}", quant_config)
            for e in range(cfg.num_experts))

    def native_mlp(self) -> NativeMLP:
        """The experts as the native loop runs them (NativeDecoder.add_moe)."""
        return NativeMLP(moe=self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.gate(x), self.cfg)
        return self.tp.all_reduce(moe_forward(x, weights, chosen, self.experts))
