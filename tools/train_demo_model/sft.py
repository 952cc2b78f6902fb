"""The instruction-tuning stage: question-and-answer pairs (qa.py) in the demo model's chat format,
with the loss on the answer's tokens (and the end token after it) only, so the model learns to
answer briefly and to stop, not to predict questions."""
from __future__ import annotations

import random

import torch

from tools.train_demo_model.qa import QAPair

SYSTEM_PROMPTS = ("", "", "You answer questions about Python and its documentation.",
                  "You are a helpful assistant. Answer in a sentence or two.")
IGNORE = -100  # cross_entropy's ignore_index


def chat_example(tok, pair: QAPair, system: str, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one exchange in the chat template's format; None if too long."""
    prompt = (f"<|system|>\n{system}<|end|>\n" if system else "") + f"<|user|>\n{pair.question}<|end|>\n<|assistant|>\n"
    prompt_ids = tok.encode(prompt).ids
    answer_ids = tok.encode(f"{pair.answer}<|end|>").ids
    ids = prompt_ids + answer_ids
    if len(ids) > max_len:
        return None
    return ids, [IGNORE] * len(prompt_ids) + answer_ids


def examples(tok, pairs: list[QAPair], max_len: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = [chat_example(tok, p, rng.choice(SYSTEM_PROMPTS), max_len) for p in pairs]
    return [e for e in out if e is not None]


def batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and next-token labels: labels[i] is what position i predicts."""
    width = max(len(ids) for ids, _ in items) - 1
    x = torch.full((len(items), width), pad_id)
    y = torch.full((len(items), width), IGNORE)
    for row, (ids, labels) in enumerate(items):
        x[row, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[row, :len(ids) - 1] = torch.tensor(labels[1:])
    return x, y
