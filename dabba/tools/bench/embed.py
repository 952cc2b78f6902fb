"""`dabba bench embed`: embedding throughput of the engine in this process, documents/s and tokens/s
for inputs of a given length, submitted ``batch_size`` at a time (all at once by default). The
inputs are texts (random token ids decoded, so that a peer reading text reads the same ones),
tokenized as the server would. Prints JSON."""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

FIRST_TOKEN_ID = 3  # past <unk>/<s>/</s>-style specials


@dataclass(frozen=True)
class EmbedWorkload:
    num_prompts: int = 512
    input_len: int = 256
    batch_size: int | None = None  # inputs per embed() call; None: all at once
    seed: int = 0


def make_texts(w: EmbedWorkload, tokenizer: Any, vocab_size: int) -> list[str]:
    """Texts of about ``input_len`` tokens each: random ids below the tokenizer's (and model's)
    vocabulary, decoded."""
    rng = random.Random(w.seed)
    top = min(vocab_size, tokenizer.vocab_size)
    return [tokenizer.decode([rng.randrange(FIRST_TOKEN_ID, top) for _ in range(w.input_len)])
            for _ in range(w.num_prompts)]


def bench_embed(model: str, w: EmbedWorkload, **engine_kwargs: Any) -> dict[str, Any]:
    from dabba import LLM

    llm = LLM(model, **engine_kwargs)
    info = llm.llm_engine.model_info
    texts = make_texts(w, info.tokenizer, info.vocab_size)
    llm.embed(texts[:4], use_tqdm=False)  # warm: the model's first shapes, the kernels' first loads
    batch = w.batch_size or len(texts)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(texts), batch):
        outputs += llm.embed(texts[i:i + batch], use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"benchmark": "embed", "model": model, **asdict(w), "engine": engine_kwargs,
            "dimensions": len(outputs[0].outputs.embedding), "elapsed_s": elapsed,
            "documents_per_s": len(outputs) / elapsed, "tokens_per_s": num_tokens / elapsed,
            "mean_input_tokens": num_tokens / len(outputs)}
