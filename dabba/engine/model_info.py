"""What a front end knows of the model an engine serves, handed to it in place of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dabba.arch.pooling_config import PoolerConfig
from dabba.config import DEFAULT_IMAGES_PER_PROMPT
from dabba.engine.prompt_images import ImagePrompt
from dabba.engine.tokenizer import Tokenizer
from dabba.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dabba.models.lora_adapter import AdapterLimits


@dataclass(frozen=True)
class ModelInfo:
    """The facts every client of one engine shares: the server renders chat templates and counts
    tokens with them, a router hashes prompts in the cache's blocks. Read-only, so any thread may
    read it while the engine steps."""

    architecture: str  # config.json's, e.g. "LlamaForCausalLM"
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens of one request
    vocab_size: int  # the model's (token ids run 0 .. vocab_size - 1)
    eos_token_ids: frozenset[int]  # generation_config's and the tokenizer's
    block_size: int  # tokens per KV block: the prefix cache's unit
    generation_config: dict[str, Any] = field(default_factory=dict)  # generation_config.json, as read
    runner: str = "generate"  # "pooling": it embeds only (no LM head)
    pooler: PoolerConfig | None = None  # how its embeddings pool; None: it does not embed
    hidden_size: int = 0  # an embedding's length (before dimensions cut it)
    encoder: bool = False  # a BERT-style encoder: each input runs whole in one step, no prefix cache
    image_prompt: ImagePrompt | None = None  # how images enter its prompts; None: it takes none
    max_images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT  # limit_mm_per_prompt's
    lora: AdapterLimits | None = None  # what adapters must fit (enable_lora); None: it serves none

    def default_sampling_params(self) -> SamplingParams:
        """Defaults from generation_config.json, as the checkpoint's authors meant them."""
        gen = self.generation_config
        if not gen.get("do_sample", True):
            return SamplingParams(temperature=0.0)
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        defaults = {k: gen[k] for k in keys if gen.get(k) is not None}
        if defaults.get("top_k") == 0:  # transformers' "disabled"
            defaults["top_k"] = -1
        return SamplingParams(**defaults)
