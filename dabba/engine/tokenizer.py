"""Tokenizer from tokenizer.json (the `tokenizers` library) plus tokenizer_config.json for
special tokens and the chat template (rendered with jinja2 in a sandbox)."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from dabba.arch.files import read_json_object


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as a serialised AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizer the tokenizers library can read ({e})") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = read_json_object(config_path) if config_path.is_file() else {}
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.chat_template = self._find_chat_template(model_dir)

    def _find_chat_template(self, model_dir: Path) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers` object (for DecodeStream)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> set[int]:
        return {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )
