"""A conversation as the engine's prompt, through the chat template: shared by the server's chat
APIs and LLM.chat, so that every door renders a conversation the same way."""
from __future__ import annotations

from typing import Any

from PIL import Image

from dabba.engine.prompt_images import ImagePrompt
from dabba.engine.tokenizer import Tokenizer
from dabba.multimodal.media import ImageSource

# Variables the conversation itself sets: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def render_conversation(tokenizer: Tokenizer, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None, images: list[Image.Image] | None = None,
                        image_prompt: ImagePrompt | None = None) -> dict[str, Any]:
    """{"prompt": text, "prompt_token_ids": ids} of ``conversation`` (messages as templates take
    them). ``chat_template_kwargs``: the template's own variables (Qwen3's enable_thinking, ...).
    A template that fails on the conversation is a ValueError saying why; the template writes the
    special tokens itself, so none are added. With ``images`` (template_content's), each image's
    mark grows into the model's image sequence before the text is tokenized, as transformers'
    processors do, and the images ride along as multi_modal_data."""
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
    if not images:
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    assert image_prompt is not None, "template_content takes images only for a model that reads them"
    expanded = image_prompt.expand_text(text, images)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(expanded, add_special_tokens=False),
            "multi_modal_data": {"image": images}}


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


def template_content(content: Any, where: str, images: list[Image.Image], source: ImageSource | None = None
                     ) -> str | list[dict[str, Any]]:
    """A message's content as chat templates take it: text (a string, or text parts joined), or
    where it has image parts, its parts as Hugging Face vision templates read them ({"type":
    "text", "text": ...} and {"type": "image"}), each image opened (``source``: where images may
    come from; None: the model takes none) and appended to ``images``. Image parts: OpenAI's
    {"type": "image_url", "image_url": {"url": ...}} and, from Python, {"type": "image_pil",
    "image_pil": a PIL image} (vLLM's)."""
    if not isinstance(content, list) or all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.{j}.text must be a string")
            parts.append({"type": "text", "text": part["text"]})
            continue
        if kind not in ("image_url", "image_pil"):
            raise ValueError(f"{where}.{j}: content parts are text or image_url, not {kind!r}")
        if source is None:
            raise ValueError(f"{where}.{j}: this model takes no images")
        if kind == "image_pil":
            image = part.get("image_pil")
            if not isinstance(image, Image.Image):
                raise ValueError(f"{where}.{j}.image_pil must be a PIL image")
            images.append(source.accept(image, f"{where}.{j}.image_pil"))
        else:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(source.open(url, f"{where}.{j}.image_url"))
        parts.append({"type": "image"})
    return parts
