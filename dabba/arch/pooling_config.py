"""How a checkpoint pools its hidden states into one embedding: from its sentence-transformers files
(modules.json, the Pooling module's config.json, config_sentence_transformers.json's prompts)
where it has them, else from its family's convention, else as the operator's flag says."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dabba.arch.files import read_json, read_json_object
from dabba.config import POOLING_TYPES
# sentence-transformers' Pooling modes -> ours (the modes it has that we do not are refused by name)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_PREFIX = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolerConfig:
    """``pooling_type``: LAST (the last token's hidden state: causal models, which have seen the
    whole input there), MEAN (the average over every token) or CLS (the first token's);
    ``normalize``: L2-normalise by default; ``matryoshka``: the model was trained so that a prefix
    of its embedding is an embedding (a request may ask for ``dimensions``); ``prompt``: text put
    before every input (sentence-transformers' default prompt); ``source``: where this came from;
    ``task``: "embed" (the pooled vector is the output) or "score" (a cross-encoder: the first
    token's state goes through the model's classifier, a text pair's relevance logit);
    ``pair_template``: a scorer that reads each pair inside a prompt of its own (Qwen3-Reranker's),
    a str.format template over {instruction}, {query} and {document}, with ``instruction``'s default."""

    pooling_type: str
    normalize: bool
    matryoshka: bool = False
    prompt: str = ""
    source: str = "the family's convention"
    task: str = "embed"
    pair_template: str = ""
    instruction: str = ""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @property
    def needs_all_tokens(self) -> bool:
        """Whether every input token's hidden state is pooled: a prefix-cache hit would skip some."""
        return self.pooling_type != "LAST"


CROSS_ENCODER = PoolerConfig("CLS", False, source="a sequence classifier (its first token)", task="score")
DECODER_SCORER = PoolerConfig("LAST", False, source="a decoder's sequence classifier (its last token)", task="score")
# Qwen3-Reranker's judging prompt and default instruction, as its model card builds them
QWEN3_RERANKER_TEMPLATE = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
QWEN3_RERANKER = PoolerConfig("LAST", False, source="Qwen3-Reranker as released (yes against no)", task="score",
                              pair_template=QWEN3_RERANKER_TEMPLATE,
                              instruction="Given a web search query, retrieve relevant passages that answer the query")


def is_sentence_transformer(model_dir: Path) -> bool:
    return (model_dir / "modules.json").is_file()


def read_pooler_config(model_dir: Path, hf_config: dict[str, Any], pooling_type: str | None = None,
                       convention: str = "LAST") -> PoolerConfig:
    """The checkpoint's pooling; ``pooling_type`` (the operator's flag) overrides its type. The
    family's ``convention``, normalised, where the checkpoint says nothing: a decoder's is LAST
    (Qwen3-Embedding, gte-Qwen2), an encoder's CLS (BERT's; vLLM's defaults both)."""
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    if is_sentence_transformer(model_dir):
        config = _sentence_transformers_config(model_dir, matryoshka)
    else:
        config = PoolerConfig(convention, True, matryoshka)
    if pooling_type is not None:
        config = PoolerConfig(pooling_type.upper(), config.normalize, config.matryoshka, config.prompt,
                              f"{config.source}, its type set by pooling_type")
    return config


def _sentence_transformers_config(model_dir: Path, matryoshka: bool) -> PoolerConfig:
    modules_file = model_dir / "modules.json"
    modules = read_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise ValueError(f"{modules_file} must list modules, each with a type")
    pooling_type, normalize = None, False
    for module in modules:
        kind = module["type"].removeprefix(_ST_PREFIX)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _pooling_mode(model_dir, module.get("path"))
        else:
            raise ValueError(f"{modules_file}: the sentence-transformers module {module['type']!r} is not supported "
                             "(Transformer, Pooling and Normalize are)")
    if pooling_type is None:
        raise ValueError(f"{modules_file} has no Pooling module")
    return PoolerConfig(pooling_type, normalize, matryoshka, _default_prompt(model_dir),
                        f"{modules_file.name} (sentence-transformers)")


def _pooling_mode(model_dir: Path, path: Any) -> str:
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        raise ValueError(f"{model_dir / 'modules.json'}: the Pooling module's path must be a folder inside the "
                         f"checkpoint, got {path!r}")
    config_file = model_dir / path / "config.json"
    config = read_json_object(config_file)
    modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{config_file}: pooling modes {modes} are not supported (exactly one of "
                         f"{sorted(_ST_MODES)})")
    return _ST_MODES[modes[0]]


def _default_prompt(model_dir: Path) -> str:
    """config_sentence_transformers.json's default prompt (sentence-transformers puts it before
    every input that names no other), else none."""
    path = model_dir / "config_sentence_transformers.json"
    if not path.is_file():
        return ""
    config = read_json_object(path)
    name, prompts = config.get("default_prompt_name"), config.get("prompts") or {}
    if name is None:
        return ""
    if not isinstance(prompts, dict) or not isinstance(prompts.get(name), str):
        raise ValueError(f"{path}: default_prompt_name {name!r} names no prompt")
    return prompts[name]
