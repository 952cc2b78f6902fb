"""Quality of a model on a text: perplexity through the engine itself (prompt logprobs), so that
what is measured is exactly what dabba serves (its kernels, its quantization, its KV cache); and
the KL divergence of a quantized model from its full-precision reference."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from dabba.entrypoints.llm import LLM
from dabba.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
    bits_per_byte: float  # the scored tokens' bits over the text's UTF-8 bytes: models with other tokenizers compare
    num_tokens: int  # tokens scored
    num_windows: int
    max_length: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity(llm: LLM, text: str, max_length: int = 256, stride: int = 128) -> PerplexityResult:
    """Sliding windows of ``max_length`` tokens, each starting ``stride`` after the previous one;
    every token is scored once, in the first window that covers it with at least
    ``max_length - stride`` tokens of context (except at the start of the text)::

        window k: | context (scored before) | scored now |
                  begin                prev_end        end
    """
    if not 0 < stride <= max_length:
        raise ValueError(f"stride must be in (0, max_length={max_length}], got {stride}")
    max_model_len = llm.llm_engine.model_info.max_model_len
    if max_length + 1 > max_model_len:
        raise ValueError(f"max_length must be < max_model_len ({max_model_len}), got {max_length}")
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError("the text must hold at least 2 tokens")
    windows, scored_from = [], []
    prev_end = 0
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + max_length, len(ids))
        windows.append(ids[begin:end])
        scored_from.append(max(prev_end - begin, 1))
        prev_end = end
        if end == len(ids):
            break
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True),
                        use_tqdm=len(windows) > 8)
    nll, count = 0.0, 0
    for window, first, out in zip(windows, scored_from, outs):
        for i in range(first, len(window)):
            nll -= out.prompt_logprobs[i][window[i]].logprob
            count += 1
    return PerplexityResult(math.exp(nll / count), nll / count, nll / math.log(2) / len(text.encode()), count,
                            len(windows), max_length, stride)


@dataclass
class DivergenceResult:
    """How far a (quantized) model's next-token distributions are from a reference's, as in
    llama.cpp's ``perplexity --kl-divergence``: finer than a perplexity difference, which
    rounding noise can push either way."""

    kl_divergence: float  # mean KL(reference || model), nats per token
    top1_agreement: float  # fraction of positions where both rank the same token first
    reference_nll: float
    model_nll: float
    num_tokens: int
    num_windows: int
    max_length: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def kl_divergence(model: str, reference: str, text: str, quantization: str | None = None, dtype: str = "auto",
                  max_length: int = 256, max_windows: int = 64) -> DivergenceResult:
    """Both models run the same non-overlapping windows of ``text`` in the same dtype ("auto": the
    reference checkpoint's), layer by layer through dabba's own layers and kernels, with dense
    causal attention; ``quantization`` applies to ``model`` at load time (int8 / int4)."""
    from dabba.attention.backend import forward_context
    from dabba.attention.dense import DenseCausalBackend
    from dabba.config import EngineConfig
    from dabba.engine.tokenizer import Tokenizer
    from dabba.models.loader import load_model
    from dabba.models.resolved_config import ResolvedConfig, resolve_config

    ids = Tokenizer(reference).encode(text, add_special_tokens=False)
    num = min(max_windows, len(ids) // max_length)
    if num < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of max_length={max_length}")
    windows = torch.tensor(ids[:num * max_length]).view(num, max_length)

    def resolve(path: str, quant: str | None, dtype: str) -> ResolvedConfig:
        return resolve_config(EngineConfig.from_kwargs(model=path, quantization=quant, dtype=dtype, device="cpu"))

    def load(r: ResolvedConfig) -> torch.nn.Module:
        return load_model(r.model_dir, r.arch, r.dtype, r.device, max_length, r.quant_config)

    resolved_reference = resolve(reference, None, dtype)  # both in its dtype ("auto": the checkpoint's)
    same_dtype = str(resolved_reference.dtype).removeprefix("torch.")
    models = [load(resolved_reference), load(resolve(model, quantization, same_dtype))]
    if models[0].config.vocab_size != models[1].config.vocab_size:
        raise ValueError("model and reference must share a vocabulary")
    backend = DenseCausalBackend(max_length)
    batch = max(1, (1 << 24) // (max_length * models[0].config.vocab_size))  # windows per pass: ~64 MB of logits
    kl = agree = nll_ref = nll_model = 0.0
    for chunk in windows.split(batch):
        positions = torch.arange(max_length).repeat(len(chunk))
        logprobs = []
        for m in models:
            with forward_context(backend, [None], [None] * m.config.num_hidden_layers):
                logits = m.compute_logits(m(chunk.flatten(), positions)).float()
            logprobs.append(torch.log_softmax(logits.view(len(chunk), max_length, -1)[:, :-1], dim=-1))
        ref, cand = logprobs
        targets = chunk[:, 1:, None]
        kl += (ref.exp() * (ref - cand)).sum(-1).sum().item()
        agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
        nll_ref -= ref.gather(-1, targets).sum().item()
        nll_model -= cand.gather(-1, targets).sum().item()
    n = num * (max_length - 1)
    return DivergenceResult(kl / n, agree / n, nll_ref / n, nll_model / n, n, num, max_length)
