"""Where a model's files come from: a local directory as it is, else a Hugging Face Hub repo id.

A repo id is resolved with huggingface_hub, as every peer engine does: its cache (``HF_HOME`` /
``HF_HUB_CACHE``, or ``download_dir``), revisions, ``HF_TOKEN`` for gated and private repos,
``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and its progress bars. Only what dabba reads is downloaded:
configs, tokenizer files and safetensors (never pickled weights, which dabba refuses to load).
"""
from __future__ import annotations

from pathlib import Path

CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
MODEL_FILES = CONFIG_FILES + TOKENIZER_FILES + WEIGHT_FILES


def resolve_model_dir(model: str, revision: str | None = None, download_dir: str | None = None,
                      allow_patterns: list[str] = MODEL_FILES, field: str = "model") -> Path:
    """``model`` as a directory holding its files: a local directory, or a Hub repo's snapshot
    in the cache, downloaded first where needed. Raises ValueError naming ``field`` and what to
    do when it cannot be had. ``revision`` (a branch, tag or commit) applies to repo ids only."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":  # llama.cpp's file: its metadata as checkpoint files
        if not path.is_file():
            raise ValueError(f"{field}={model!r}: no such GGUF file")
        from dabba.models.gguf_checkpoint import gguf_model_dir

        return gguf_model_dir(path)
    if model.count("/") > 1 or model.startswith(("/", ".", "~")) or not model.strip():
        raise ValueError(f"{field}={model!r} is not a local directory (nor a Hugging Face Hub repo id such as "
                         "'Qwen/Qwen2.5-0.5B-Instruct')")
    snapshot = _download(model, revision, download_dir, allow_patterns, field)
    if "*.safetensors" in allow_patterns and not any(snapshot.glob("*.safetensors")):
        raise ValueError(f"{field}={model!r}{_at(revision)} has no safetensors weights on the Hub; dabba never loads "
                         "pickled checkpoints (.bin, .pt): choose a repo that ships *.safetensors, or convert it")
    return snapshot


def _download(repo_id: str, revision: str | None, download_dir: str | None, allow_patterns: list[str],
              field: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{field}={repo_id!r}{_at(revision)}"
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=allow_patterns))
    except HFValidationError as e:
        raise ValueError(f"{field}={repo_id!r} is neither a local directory nor a valid Hub repo id ({e})") from None
    except GatedRepoError:
        raise ValueError(f"{where} is a gated repo: accept its terms on its Hub page, then set HF_TOKEN to a token "
                         "of that account") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{where}: no such local directory, and no such Hub repo (or it is private: set "
                         "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{where}: the repo has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        cache = download_dir or "the Hugging Face cache"
        if _offline():
            raise ValueError(f"{where} is not in {cache} and HF_HUB_OFFLINE is set: download it first "
                             f"(`hf download {repo_id}`) or unset HF_HUB_OFFLINE") from None
        raise ValueError(f"{where} is not in {cache} and the Hub could not be reached: check the network "
                         "(HF_ENDPOINT) or pass a local directory") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{where}: downloading from the Hub failed ({e})") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _at(revision: str | None) -> str:
    return f" (revision {revision!r})" if revision else ""
