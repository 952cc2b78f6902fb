"""Perplexity of a model on a text, through the engine itself (prompt logprobs), so that what is
measured is exactly what dabba serves: its kernels, its quantization, its KV cache."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dabba.entrypoints.llm import LLM
from dabba.sampling_params import SamplingParams


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float  # nats per scored token
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
    if max_length + 1 > llm.llm_engine.max_model_len:
        raise ValueError(f"max_length must be < max_model_len ({llm.llm_engine.max_model_len}), got {max_length}")
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
    return PerplexityResult(math.exp(nll / count), nll / count, count, len(windows), max_length, stride)
