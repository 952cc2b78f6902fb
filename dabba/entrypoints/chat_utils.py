"""A conversation as the engine's prompt, through the chat template: shared by the server's chat
APIs and LLM.chat, so that every door renders a conversation the same way."""
from __future__ import annotations

from typing import Any

from dabba.engine.tokenizer import Tokenizer

# Variables the conversation itself sets: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def render_conversation(tokenizer: Tokenizer, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"prompt": text, "prompt_token_ids": ids} of ``conversation`` (messages as templates take
    them). ``chat_template_kwargs``: the template's own variables (Qwen3's enable_thinking, ...).
    A template that fails on the conversation is a ValueError saying why; the template writes the
    special tokens itself, so none are added."""
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} set by the request itself, not here")
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # jinja's TemplateError (raise_exception), or a template that trips on the input
        raise ValueError(f"chat template failed: {e}") from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"{where}.{j}: only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.{j}.text must be a string")
        texts.append(part["text"])
    return "".join(texts)
