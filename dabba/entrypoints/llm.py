"""The offline Python API: ``LLM(model).generate(prompts, params)``, ``LLM(model).embed(texts)``."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from dabba.config import EngineConfig
from dabba.core.stats import SchedulerStats
from dabba.engine.llm_engine import LLMEngine, PromptType
from dabba.engine.tokenizer import Tokenizer
from dabba.entrypoints.chat_utils import render_conversation, template_content
from dabba.multimodal.media import ImageSource
from dabba.entrypoints.scoring import pair_up, plan_scoring
from dabba.lora_request import LoRARequest
from dabba.outputs import PoolingRequestOutput, RequestOutput, RerankResult, ScoringOutput, ScoringRequestOutput
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Load a Hugging Face checkpoint directory and generate from batches of prompts.

    Keyword options are those of EngineConfig's parts (dtype, max_model_len, block_size,
    kv_cache_memory, enable_prefix_caching, max_num_seqs, max_num_batched_tokens, ...).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.model_info.tokenizer

    def get_stats(self) -> SchedulerStats:
        """The batch and the KV cache now: running/waiting requests, blocks and token slots in
        use, how many slots hold real tokens, prefix-cache hits."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (vLLM's LLM.reset_prefix_cache); False while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a
        list of them, as vLLM's LLM.chat: the chat template (``chat_template``'s text in place of
        the model's) renders each, with ``chat_template_kwargs`` (Qwen3's enable_thinking, ...)
        and ``tools``; then generate(). A vision-language model takes image parts too:
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} or {"type":
        "image_pil", "image_pil": image}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer, prompts = self.get_tokenizer(), []
        image_prompt = self.llm_engine.model_info.image_prompt
        source = ImageSource(check=image_prompt.check) if image_prompt is not None else None  # no fetching
        for c, conversation in enumerate(conversations):
            rendered, images = [], []
            for i, message in enumerate(conversation):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise ValueError(f"messages[{c}][{i}]: a message is a dict with a 'role'")
                content = template_content(message.get("content"), f"messages[{c}][{i}].content", images, source)
                rendered.append({**message, "content": content})
            prompts.append(render_conversation(tokenizer, rendered, add_generation_prompt, tools, chat_template,
                                               chat_template_kwargs, images, image_prompt))
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order. Each prompt's
        result is its one FINAL_ONLY output, whatever output_kind the params name.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base
        model), where the LLM was made with enable_lora=True."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        return self._run(prompts, params, priority, "Generating", use_tqdm, loras)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding (``out.outputs.embedding``), in input order, as vLLM's
        LLM.embed: pooled as the checkpoint says (arch/pooling_config.py); ``pooling_params``
        ask for ``dimensions`` or another normalisation; ``truncate_prompt_tokens`` keeps each
        input's last tokens."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        pooling_params = pooling_params if pooling_params is not None else PoolingParams()
        params = ([pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams)
                  else list(pooling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run(prompts, params, None, "Embedding", use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None, instruction: str | None = None) -> list[ScoringRequestOutput]:
        """How well each text_2 answers text_1 (one text_1 against every text_2, or two lists pairwise),
        as vLLM's LLM.score: a cross-encoder's sigmoid of its logit for the pair, or an embedding
        model's cosine similarity of the two (entrypoints/scoring.py); ``instruction``: what a
        reranker with a judging prompt (Qwen3-Reranker) judges by."""
        pairs = pair_up(text_1 if isinstance(text_1, str) else list(text_1),
                        text_2 if isinstance(text_2, str) else list(text_2))
        plan = plan_scoring(self.llm_engine.model_info, pairs, instruction)
        outs = self.embed(plan.prompts, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        scores = plan.scores([o.outputs.embedding for o in outs])
        per_pair = len(outs) // len(pairs)
        return [ScoringRequestOutput(f"score-{next(self._counter)}",
                                     [t for o in outs[i * per_pair:(i + 1) * per_pair] for t in o.prompt_token_ids],
                                     ScoringOutput(score)) for i, score in enumerate(scores)]

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               use_tqdm: bool = True, instruction: str | None = None) -> list[RerankResult]:
        """The documents ordered by how well each answers ``query`` (score()), best first; the
        first ``top_n`` of them."""
        documents = list(documents)
        scores = [o.outputs.score for o in self.score(query, documents, use_tqdm, instruction=instruction)]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        return [RerankResult(i, documents[i], scores[i]) for i in order[:top_n]]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams] | list[PoolingParams],
             priority: Sequence[int] | None, what: str, use_tqdm: bool,
             loras: list[LoRARequest | None] | None = None) -> list[Any]:
        """Add every prompt (all or none), step until each has its final output; in input order."""
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        engine = self.llm_engine
        request_ids = [f"req-{next(self._counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, p, prio, lora in zip(request_ids, prompts, params, priorities,
                                                         loras or [None] * len(prompts)):
                engine.add_request(request_id, prompt, p, prio, lora)
                added.append(request_id)
        except ValueError:
            for request_id in added:  # all or nothing: leave no half-submitted batch behind
                engine.abort_request(request_id)
            raise

        results: dict[str, Any] = {}
        with tqdm(total=len(prompts), desc=what, unit="req", disable=not use_tqdm) as bar:
            num_output_tokens = 0
            while len(results) < len(prompts) and engine.has_unfinished_requests():
                for out in engine.step():  # FINAL_ONLY (and pooling): each output is a finished prompt
                    results[out.request_id] = out
                    if isinstance(out, RequestOutput):
                        num_output_tokens += sum(len(o.token_ids) for o in out.outputs)
                        bar.set_postfix(out_tok_s=f"{num_output_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f}")
                    bar.update(1)
        return [results[r] for r in request_ids]
