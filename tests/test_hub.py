"""A model given as a Hugging Face Hub repo id: downloaded with huggingface_hub from a loopback
server that answers under the Hub's URL scheme (tests/fake_hub.py, reached through HF_ENDPOINT),
then served from the cache, offline too. Each case runs in a fresh interpreter (tests/hub_client.py
or the CLI), since huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE at import."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Checkpoint
from tests.fake_hub import FakeHub, FakeRepo, repo_from_dir

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}


def hub_env(hub: FakeHub, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def run_jobs(hub: FakeHub, cache: Path, jobs: list[dict], **env: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.hub_client", json.dumps(jobs)], cwd=ROOT, capture_output=True,
                          text=True, env=hub_env(hub, cache, **env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def greedy(ckpt: Checkpoint, i: int = 3) -> dict:
    """What a job on prompt ``i`` of ``ckpt`` must return: transformers' first 8 greedy tokens."""
    return {"prompt": ckpt.prompts[i], "want": ckpt.reference[i][:8]}


@pytest.fixture
def repos(checkpoints) -> dict[str, FakeRepo]:
    llama, mistral = checkpoints["llama"].path, checkpoints["mistral"].path
    extras = {"pytorch_model.bin": b"pickle", "README.md": b"# tiny", "original/consolidated.pth": b"pickle"}
    weights_only = {k: v for k, v in repo_from_dir(llama).items() if k not in TOKENIZER_FILES}
    return {
        "acme/tiny": FakeRepo({"main": repo_from_dir(llama, extras), "v2": repo_from_dir(mistral)}),
        "acme/no-tokenizer": FakeRepo({"main": weights_only}),
        "acme/tokenizer": FakeRepo({"main": {k: v for k, v in repo_from_dir(llama).items() if k in TOKENIZER_FILES}}),
        "acme/gated": FakeRepo({"main": repo_from_dir(llama)}, token="hf_secret"),
        "acme/pickled": FakeRepo({"main": {k: v for k, v in repo_from_dir(llama, extras).items()
                                           if not k.endswith(".safetensors")}}),
    }


def test_a_repo_id_downloads_only_what_dabba_reads_then_serves_offline(checkpoints, repos, tmp_path) -> None:
    llama, mistral = greedy(checkpoints["llama"]), greedy(checkpoints["mistral"])
    cache = tmp_path / "hf"
    with FakeHub(repos) as hub:
        jobs = [{"model": "acme/tiny", "prompt": llama["prompt"]},
                {"model": "acme/tiny", "options": {"revision": "v2"}, "prompt": mistral["prompt"]},
                {"model": "acme/tiny", "options": {"revision": "nope"}, "prompt": [1]}]
        main, v2, missing_revision = run_jobs(hub, cache, jobs)
        assert main["token_ids"] == llama["want"] and v2["token_ids"] == mistral["want"]
        assert missing_revision == {"error": "model='acme/tiny' (revision 'nope'): the repo has no revision 'nope'"}
        files = set(repo_from_dir(checkpoints["llama"].path)) | set(repo_from_dir(checkpoints["mistral"].path))
        assert hub.fetched_files() == files  # configs, tokenizer, safetensors; no pickles, README or others
        assert not any(f.endswith((".bin", ".pth", ".md")) for f in files)
        snapshots = list((cache / "hub" / "models--acme--tiny" / "snapshots").iterdir())
        assert len(snapshots) == 2  # main's and v2's commits, in the standard HF cache layout
        num_requests = len(hub.requests)

        offline = run_jobs(hub, cache, jobs[:2] + [{"model": "acme/gated", "prompt": [1]}], HF_HUB_OFFLINE="1")
        assert len(hub.requests) == num_requests  # nothing asked of the Hub
    assert [o.get("token_ids") for o in offline[:2]] == [llama["want"], mistral["want"]]
    assert offline[2] == {"error": f"model='acme/gated' is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                                   "download it first (`hf download acme/gated`) or unset HF_HUB_OFFLINE"}


def test_download_dir_tokenizer_repo_and_gated_repos(checkpoints, repos, tmp_path) -> None:
    llama = greedy(checkpoints["llama"])
    download_dir = tmp_path / "models"
    with FakeHub(repos) as hub:
        results = run_jobs(hub, tmp_path / "hf", [
            {"model": "acme/no-tokenizer", "options": {"download_dir": str(download_dir)}, "prompt": llama["prompt"]},
            {"model": "acme/no-tokenizer", "prompt": llama["prompt"],
             "options": {"download_dir": str(download_dir), "tokenizer": "acme/tokenizer"}},
            {"model": "acme/gated", "prompt": llama["prompt"]},
            {"model": "acme/gated", "prompt": llama["prompt"], "env": {"HF_TOKEN": "hf_secret"}},
            {"model": "acme/pickled", "prompt": [1]},
            {"model": "acme/nobody", "prompt": [1]},
        ])
    no_tokenizer, with_tokenizer, gated, with_token, pickled, nobody = results
    assert no_tokenizer["error"].endswith("has no tokenizer.json (only fast tokenizers are supported)")
    assert with_tokenizer["token_ids"] == llama["want"]
    assert {p.name for p in download_dir.iterdir()} >= {"models--acme--no-tokenizer", "models--acme--tokenizer"}
    assert not (tmp_path / "hf" / "hub" / "models--acme--no-tokenizer").exists()
    assert gated == {"error": "model='acme/gated' is a gated repo: accept its terms on its Hub page, then set HF_TOKEN "
                              "to a token of that account"}
    assert with_token["token_ids"] == llama["want"]
    assert pickled == {"error": "model='acme/pickled' has no safetensors weights on the Hub; dabba never loads pickled "
                                "checkpoints (.bin, .pt): choose a repo that ships *.safetensors, or convert it, or "
                                "take one of its GGUF files (owner/repo:Q4_K_M)"}
    assert nobody == {"error": "model='acme/nobody': no such local directory, and no such Hub repo (or it is "
                               "private: set HF_TOKEN)"}


def test_the_cli_takes_repo_ids_and_fails_in_one_line(checkpoints, repos, tmp_path) -> None:
    cli = [sys.executable, "-m", "dabba.entrypoints.cli"]
    with FakeHub(repos) as hub:
        env = hub_env(hub, tmp_path / "hf")
        plan = subprocess.run(cli + ["plan", "acme/tiny", "--json"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert plan.returncode == 0, plan.stderr
        assert json.loads(plan.stdout)["model"] == "acme/tiny"
        assert hub.fetched_files() == {"config.json", "generation_config.json"}  # a plan reads no weights
        offline = subprocess.run(cli + ["generate", "acme/elsewhere", "--prompt", "hi"], cwd=ROOT, capture_output=True,
                                 text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert offline.returncode == 2
    assert offline.stderr.strip().splitlines() == [
        "error: model='acme/elsewhere' is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it "
        "first (`hf download acme/elsewhere`) or unset HF_HUB_OFFLINE"]


def test_neither_a_directory_nor_a_repo_id(tmp_path) -> None:
    from dabba import LLM

    for model in (str(tmp_path / "missing"), "./missing", "a/b/c"):
        with pytest.raises(ValueError, match=r"is not a local directory \(nor a Hugging Face Hub repo id"):
            LLM(model)


def test_dabba_quantize_takes_a_repo_id(checkpoints, repos, tmp_path) -> None:
    """`dabba quantize acme/tiny OUT` downloads what dabba reads and writes the checkpoint that
    quantizing the same weights from a local directory writes."""
    from safetensors.torch import load_file

    from dabba.entrypoints.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"word{i}" for i in range(3000)))
    flags = ["--method", "rtn", "--bits", "8", "--group-size", "32", "--calibration", str(calib)]
    with FakeHub(repos) as hub:
        proc = subprocess.run([sys.executable, "-m", "dabba.entrypoints.cli", "quantize", "acme/tiny",
                               str(tmp_path / "from_hub"), *flags], cwd=ROOT, env=hub_env(hub, tmp_path / "hf"),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "pytorch_model.bin" not in hub.fetched_files() and "model.safetensors" in hub.fetched_files()
    assert json.loads(proc.stdout.strip().splitlines()[-1])["out"] == str(tmp_path / "from_hub")
    assert main(["quantize", str(checkpoints["llama"].path), str(tmp_path / "local"), *flags]) == 0
    from_hub, local = (load_file(tmp_path / d / "model.safetensors") for d in ("from_hub", "local"))
    assert from_hub.keys() == local.keys() and all(from_hub[k].equal(local[k]) for k in local)
    assert json.loads((tmp_path / "from_hub" / "config.json").read_text()) == json.loads(
        (tmp_path / "local" / "config.json").read_text())
