"""GGUF files as llama.cpp users have them, served: tiny random checkpoints of each family converted
by llama.cpp's own convert_hf_to_gguf.py (scripts/peer-llamacpp.sh unpacks it into .peers/; CI
fails where it is missing, a developer's run skips) give transformers' greedy tokens on the source
checkpoint (F32 and F16 files), and the tokenizer built from the file encodes text exactly as the
source tokenizer does. (Quantized files, made by llama.cpp's own quantizer, are held to llama.cpp's
outputs in tests/test_gguf_llamacpp.py; their blocks to gguf-py in tests/quantization/test_gguf_blocks.py.)"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from dabba import LLM, SamplingParams
from dabba.models.gguf_checkpoint import gguf_model_dir
from dabba.models.hub import resolve_model_dir

from tests.conftest import token_prompts
from tests.gguf_families import LLAMA_CPP, converter_view, make_gguf

FAMILIES = ["llama", "qwen2", "qwen3", "mixtral", "qwen3moe", "olmoe", "phi3", "gemma3", "gemma2"]
MULTILINGUAL = "Héllo, wörld! 你好，世界 — καλημέρα κόσμε; Привет 123 4567 def f(x):\n\treturn x**2  # ✓ 🐍"


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{LLAMA_CPP} is missing: run scripts/peer-llamacpp.sh")
        pytest.skip("llama.cpp's converter is not unpacked (scripts/peer-llamacpp.sh)")
    return LLAMA_CPP


@pytest.fixture(scope="session")
def gguf_files(llama_cpp, gguf_sources, tmp_path_factory):
    """(family, type) -> the file, converted once per session."""
    made: dict[tuple[str, str, int], Path] = {}

    def source(family: str) -> Path:
        return converter_view(family, gguf_sources[family].path, tmp_path_factory.mktemp(f"source-{family}"))

    def get(family: str, gguf_type: str, split_max_tensors: int = 0) -> Path:
        """The file; split in shards of ``split_max_tensors`` tensors, its first shard."""
        key = (family, gguf_type, split_max_tensors)
        if key not in made:
            made[key] = make_gguf(source(family), tmp_path_factory.mktemp(f"gguf-{family}"), [gguf_type],
                                  sys.executable, "--split-max-tensors", str(split_max_tensors))[gguf_type]
        return made[key]

    get.source = source
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_greedy_tokens_equal_transformers_on_the_source_checkpoint(family, gguf_type, gguf_files,
                                                                    gguf_sources) -> None:
    ckpt = gguf_sources[family]
    path = gguf_files(family, gguf_type)
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(max_tokens=len(ckpt.reference[0]), temperature=0, ignore_eos=True)
    outs = llm.generate(token_prompts(ckpt.prompts), params)
    got = [o.outputs[0].token_ids for o in outs]
    if gguf_type == "f32":
        assert got == ckpt.reference
    else:  # weights rounded to float16 by the converter: the same tokens until the first near tie
        agree = sum(g[:8] == r[:8] for g, r in zip(got, ckpt.reference))
        assert agree >= len(got) - 2, (agree, len(got))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_files_tokenizer_encodes_as_the_source_does(family, gguf_files, checkpoints) -> None:
    directory = gguf_model_dir(gguf_files(family, "f32"))
    ours = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    source = HFTokenizer.from_file(str(gguf_files.source(family) / "tokenizer.json"))
    for text in (MULTILINGUAL, " leading space", "trailing  \n\n", "<|endoftext|>x"):
        assert ours.encode(text).ids == source.encode(text).ids
        assert ours.decode(ours.encode(text).ids) == source.decode(source.encode(text).ids)


def test_a_gguf_path_is_a_model_argument_and_bad_ones_are_named(gguf_files, tmp_path) -> None:
    directory = resolve_model_dir(str(gguf_files("llama", "f32")))
    assert {p.name for p in directory.iterdir()} >= {"config.json", "tokenizer.json", "model.gguf"}
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ValueError, match="model.gguf: "):
        resolve_model_dir(str(bad))


def test_a_split_file_serves_whole_from_its_first_shard(gguf_files, checkpoints, tmp_path) -> None:
    ckpt = checkpoints["llama"]
    first = gguf_files("llama", "f32", split_max_tensors=8)
    shards = sorted(first.parent.glob("model-f32-*-of-*.gguf"))
    assert first == shards[0] and len(shards) >= 3, shards
    llm = LLM(str(first), dtype="float32")
    outs = llm.generate(token_prompts(ckpt.prompts[:4]), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [r[:16] for r in ckpt.reference[:4]]
    with pytest.raises(ValueError, match=r"shard 1 of a GGUF file split in \d+: give its first shard"):
        resolve_model_dir(str(shards[1]))
    copies = tmp_path / "copies"
    copies.mkdir()
    for shard in shards:
        (copies / shard.name).write_bytes(shard.read_bytes())
    (copies / shards[-1].name).unlink()
    with pytest.raises(ValueError, match=f"{shards[-1].name}: no such file"):
        resolve_model_dir(str(copies / shards[0].name))
    (copies / shards[-1].name).write_bytes(shards[1].read_bytes())  # another shard under the last one's name
    with pytest.raises(ValueError, match=f"{shards[-1].name}: not shard {len(shards)} of {len(shards)}"):
        resolve_model_dir(str(copies / shards[0].name))


def test_a_hub_repo_of_gguf_files_takes_llama_cpps_tag_and_downloads_that_file_alone(gguf_files, checkpoints,
                                                                                      tmp_path) -> None:
    from tests.fake_hub import FakeHub, FakeRepo
    from tests.test_hub import greedy, run_jobs

    f32, f16 = gguf_files("llama", "f32").read_bytes(), gguf_files("llama", "f16").read_bytes()
    shards = sorted(gguf_files("llama", "f32", split_max_tensors=8).parent.glob("model-f32-*-of-*.gguf"))
    split = {f"split/tiny-BF16{shard.name.removeprefix('model-f32')}": shard.read_bytes() for shard in shards}
    repos = {"acme/tiny-GGUF": FakeRepo({"main": {"tiny-F32.gguf": f32, "tiny-F16.gguf": f16, "README.md": b"# tiny",
                                                  "mmproj-tiny-F32.gguf": b"not the model", **split}})}
    want = greedy(checkpoints["llama"])
    cache = tmp_path / "hf"
    with FakeHub(repos) as hub:
        jobs = [{"model": "acme/tiny-GGUF:f32", "prompt": want["prompt"]},
                {"model": "acme/tiny-GGUF:Q4_K_M", "prompt": [1]},
                {"model": "acme/tiny-GGUF", "options": {"gguf_file": "tiny-F16.gguf"}, "prompt": want["prompt"]},
                {"model": "acme/tiny-GGUF:bf16", "prompt": want["prompt"]}]
        first, missing, named, whole = run_jobs(hub, cache, jobs)
        fetched = {path.rsplit("/", 1)[-1] for method, path in hub.requests if "/resolve/" in path}
        offline = run_jobs(hub, cache, [{"model": "acme/tiny-GGUF:F32", "prompt": want["prompt"]}],
                           HF_HUB_OFFLINE="1")[0]
    assert first["token_ids"] == want["want"]
    listed = ", ".join(sorted(["tiny-F16.gguf", "tiny-F32.gguf", *(Path(n).name for n in split)]))
    assert missing["error"] == f"model='acme/tiny-GGUF' has no GGUF file for 'Q4_K_M' (its GGUF files: {listed})"
    assert named["token_ids"][:4] == want["want"][:4]
    assert whole.get("token_ids") == want["want"], whole  # a split file, named as llama.cpp names it
    # each file alone: not the README, not the projector; a split file's every shard
    assert fetched == {"tiny-F32.gguf", "tiny-F16.gguf", *(Path(n).name for n in split)}
    assert offline["token_ids"] == want["want"]
