"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a router picks each token's top-k experts,
and only the experts some token picked are read and multiplied.

The experts' weights are stacked, as one tensor each: ``w13`` [experts, 2 * intermediate, hidden]
(each expert's gate rows, then its up rows: the dense MLP's merged gate_up layout) and ``w2``
[experts, hidden, intermediate]. Checkpoints store them per expert (``experts.{e}.gate_proj`` or
Mixtral's ``w1``/``w3``/``w2``) or already stacked (transformers 5's ``experts.gate_up_proj`` and
``experts.down_proj``); the weight loader takes either.

The forward pass follows transformers' routing exactly: softmax over the router's logits in
float32, torch.topk (the same ties), renormalised over the k where the family does; then tokens
grouped by expert, one GEMM pair per active expert over its tokens, each result scaled by its
routing weight and added into the token's row in ascending expert order (as transformers' loop
adds them).
"""
from __future__ import annotations

import torch
from torch import nn

from dabba import native
from dabba.layers.activation import act_and_mul
from dabba.layers.linear import Linear
from dabba.models.config import MoEConfig


def route(router_logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k routing weights [tokens, k], expert ids [tokens, k]) as transformers computes them."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.weights_in_model_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, experts


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str) -> torch.Tensor:
    """One expert's down(act(gate) * up) on its tokens, through dabba's CPU kernels where they run."""
    hidden = native.linear_act_and_mul(x, w13, None, activation)
    if hidden is None:
        hidden = act_and_mul(native.linear(x, w13), activation)
    return native.linear(hidden, w2)


def moe_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, activation: str) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(x), reading only the experts chosen."""
    num_tokens, top_k = experts.shape
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, in token order
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    flat_weights = weights.flatten()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        y = expert_mlp(x[tokens], w13[e], w2[e], activation) * flat_weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class FusedMoE(nn.Module):
    """Router + stacked experts. ``prefix``: the block's checkpoint name (mlp or block_sparse_moe)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, activation: str, prefix: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation = activation
        self.prefix = prefix
        self.gate = Linear(hidden_size, [cfg.num_experts], prefix=f"{prefix}.gate")  # the router stays unquantized
        e, inter = cfg.num_experts, cfg.intermediate_size
        for name, shape in (("w13_weight", (e, 2 * inter, hidden_size)), ("w2_weight", (e, hidden_size, inter))):
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)

    def param_shard_ids(self, param_name: str) -> list:
        """The pieces a stacked parameter arrives in, per expert: gate (0) and up (1) of w13."""
        experts = range(self.cfg.num_experts)
        if param_name == "w13_weight":
            return [(e, j) for e in experts for j in (0, 1)]
        return [(e, None) for e in experts]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id (expert, 0 | 1 | None): that expert's gate rows, up rows or whole matrix; None:
        every expert at once (a stacked checkpoint tensor)."""
        target = param.data
        if shard_id is not None:
            expert, part = shard_id
            if not 0 <= expert < self.cfg.num_experts:
                raise ValueError(f"{self.prefix}: expert {expert} of a layer with {self.cfg.num_experts}")
            target = target[expert]
            if part is not None:
                rows = self.cfg.intermediate_size
                target = target.narrow(0, part * rows, rows)
        if target.shape != loaded.shape:
            raise ValueError(f"{self.prefix}: checkpoint tensor {tuple(loaded.shape)} != expected {tuple(target.shape)}")
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.cfg)
        return moe_forward(x, weights, experts, self.w13_weight, self.w2_weight, self.activation)
