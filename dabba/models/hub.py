"""Where a model's files come from: a local directory as it is, else a Hugging Face Hub repo id.

A repo id is resolved with huggingface_hub, as every peer engine does: its cache (``HF_HOME`` /
``HF_HUB_CACHE``, or ``download_dir``), revisions, ``HF_TOKEN`` for gated and private repos,
``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and its progress bars. Only what dabba reads is downloaded:
configs, tokenizer files and safetensors (never pickled weights, which dabba refuses to load),
or one GGUF file of a repo of them (every shard of a split one).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from dabba.arch.gguf_file import SPLIT_SHARD, shard_names

T = TypeVar("T")
# with sentence-transformers' files: how an embedding model pools (arch/pooling_config.py)
CONFIG_FILES = ["config.json", "generation_config.json", "modules.json", "*_Pooling/config.json",
                "config_sentence_transformers.json"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json"]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
MODEL_FILES = CONFIG_FILES + TOKENIZER_FILES + WEIGHT_FILES


def resolve_model_dir(model: str, revision: str | None = None, download_dir: str | None = None,
                      allow_patterns: list[str] = MODEL_FILES, field: str = "model",
                      gguf_file: str | None = None) -> Path:
    """``model`` as a directory holding its files: a local directory, a GGUF file (its metadata
    as checkpoint files), or a Hub repo's snapshot in the cache, downloaded first where needed:
    ``owner/repo:TAG`` (llama.cpp's spelling) or ``gguf_file`` takes one GGUF file of the repo
    alone. Raises ValueError naming ``field`` and what to do when it cannot be had. ``revision``
    (a branch, tag or commit) applies to repo ids only."""
    path = Path(model).expanduser()
    if path.is_dir() and gguf_file is None:
        return path
    repo_id, tag = split_gguf_tag(model)
    if path.suffix == ".gguf" and tag is None and gguf_file is None:  # llama.cpp's file
        if not path.is_file():
            raise ValueError(f"{field}={model!r}: no such GGUF file")
        return _gguf_dir(path)
    if repo_id.count("/") > 1 or repo_id.startswith(("/", ".", "~")) or not repo_id.strip():
        raise ValueError(f"{field}={model!r} is not a local directory (nor a Hugging Face Hub repo id such as "
                         "'Qwen/Qwen2.5-0.5B-Instruct')")
    if tag is not None or gguf_file is not None:
        return _gguf_dir(resolve_gguf(repo_id, tag, gguf_file, revision, download_dir, field))
    snapshot = _hub_call(lambda: _snapshot(model, revision, download_dir, allow_patterns),
                         model, revision, download_dir, field)
    if "*.safetensors" in allow_patterns and not any(snapshot.glob("*.safetensors")):
        raise ValueError(f"{field}={model!r}{_at(revision)} has no safetensors weights on the Hub; dabba never loads "
                         "pickled checkpoints (.bin, .pt): choose a repo that ships *.safetensors, or convert it, "
                         "or take one of its GGUF files (owner/repo:Q4_K_M)")
    return snapshot


def _gguf_dir(path: Path) -> Path:
    from dabba.models.gguf_checkpoint import gguf_model_dir

    return gguf_model_dir(path)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, allow_patterns: list[str],
              local_only: bool = False) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=allow_patterns,
                                  local_files_only=local_only))


def split_gguf_tag(model: str) -> tuple[str, str | None]:
    """llama.cpp's ``owner/repo:Q4_K_M`` -> ("owner/repo", "Q4_K_M"); anything else has no tag."""
    repo, sep, tag = model.rpartition(":")
    if sep and repo.count("/") == 1 and tag and "/" not in tag and not Path(model).expanduser().exists():
        return repo, tag
    return model, None


def pick_gguf(files: list[str], tag: str, where: str) -> str:
    """The repo's GGUF file whose name holds ``tag`` (in any case), as llama.cpp's -hf picks it;
    multimodal projectors (mmproj) are not the model."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    matches = [f for f in ggufs if tag.lower() in Path(f).name.lower()]
    firsts = [f for f in matches if not (m := SPLIT_SHARD.search(f)) or m.group(1) == "00001"]
    if not firsts:
        have = ", ".join(sorted(Path(f).name for f in ggufs)) or "none"
        raise ValueError(f"{where} has no GGUF file for {tag!r} (its GGUF files: {have})")
    if len(firsts) > 1:
        raise ValueError(f"{where} has several GGUF files for {tag!r} ({', '.join(sorted(firsts))}): name one with "
                         "--gguf-file")
    return firsts[0]


def resolve_gguf(repo_id: str, tag: str | None, gguf_file: str | None, revision: str | None,
                 download_dir: str | None, field: str = "model") -> Path:
    """The local path of one GGUF file of a Hub repo (``gguf_file`` by its path in the repo, else
    the one ``tag`` names), downloaded alone (a split file: its shards) into the cache where
    needed; offline, what the cache holds."""
    from huggingface_hub import hf_hub_download, list_repo_files

    where = f"{field}={repo_id!r}{_at(revision)}"
    if gguf_file is None:
        if _offline():  # no listing without the Hub: the repo's files in the cache
            cached = _hub_call(lambda: _snapshot(repo_id, revision, download_dir, ["*.gguf"], local_only=True),
                               repo_id, revision, download_dir, field)
            files = [str(p.relative_to(cached)) for p in cached.rglob("*.gguf")]
        else:
            files = _hub_call(lambda: list_repo_files(repo_id, revision=revision), repo_id, revision, download_dir,
                              field)
        gguf_file = pick_gguf(files, tag or "", where)
    shard = SPLIT_SHARD.search(gguf_file)
    if shard and shard.group(1) != "00001":
        raise ValueError(f"{where}: {gguf_file} is shard {int(shard.group(1))} of a split GGUF file: name its first "
                         "shard (-00001-of-...)")
    paths = [_hub_call(lambda: hf_hub_download(repo_id, name, revision=revision, cache_dir=download_dir),
                       repo_id, revision, download_dir, field)
             for name in shard_names(gguf_file)]  # a split file's every shard, beside the first
    return Path(paths[0])


def _hub_call(call: Callable[[], T], repo_id: str, revision: str | None, download_dir: str | None,
              field: str) -> T:
    """``call()``, with huggingface_hub's errors as ValueErrors saying what to do."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{field}={repo_id!r}{_at(revision)}"
    try:
        return call()
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
    except EntryNotFoundError:  # after its subclass LocalEntryNotFoundError
        raise ValueError(f"{where}: the repo has no such file") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{where}: downloading from the Hub failed ({e})") from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _at(revision: str | None) -> str:
    return f" (revision {revision!r})" if revision else ""
