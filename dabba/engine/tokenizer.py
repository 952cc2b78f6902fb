"""Tokenizer from tokenizer.json (the `tokenizers` library) plus tokenizer_config.json for
special tokens and the chat template (rendered with jinja2 in a sandbox)."""
from __future__ import annotations

import json
from datetime import datetime
import functools
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}`` (transformers marks the assistant's tokens
    with it for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (its globals, filters and
    extensions), sandboxed: templates come with checkpoints from anywhere."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def read_chat_template(value: str) -> str:
    """A chat template given as a file's path or as its text (``--chat-template``)."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template's text too long to be a path
        pass
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a template's text")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: one in place of the checkpoint's (a file's path or the text)."""
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
        self.chat_template = (read_chat_template(chat_template) if chat_template is not None
                              else self._find_chat_template(model_dir))
        self._templates = _template_environment()
        # compiled once per template text, not per request (a Qwen3 template takes milliseconds)
        self._compiled = functools.lru_cache(maxsize=8)(self._templates.from_string)

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

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int]]:
        """A text pair as a cross-encoder reads it (the tokenizer's pair template): ids and token types."""
        encoding = self._tok.encode(text, pair)
        return encoding.ids, encoding.type_ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """The conversation as the template writes it; ``chat_template`` in place of the
        tokenizer's, ``kwargs`` the template's other variables (tools, enable_thinking, ...)."""
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        return self._compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )
