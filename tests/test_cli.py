"""The dabba command line."""
from __future__ import annotations

import json

import pytest

from dabba.entrypoints.cli import build_parser, main


def test_generate_json(checkpoints, capsys) -> None:
    ckpt = checkpoints["qwen2"]
    rc = main(["generate", str(ckpt.path), "--prompt", "Hello", "--prompt", "The json module", "--max-tokens", "6",
               "--ignore-eos", "--json", "--kv-cache-memory", "8MiB", "--no-enable-prefix-caching"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The json module"]
    assert all(len(line["token_ids"]) == 6 and line["finish_reason"] == "length" for line in lines)


def test_engine_flags_come_from_the_config_dataclasses() -> None:
    args = build_parser().parse_args(["generate", "m", "--prompt", "x", "--kv-cache-memory", "1.5GiB",
                                      "--max-num-batched-tokens", "128", "--no-enable-prefix-caching"])
    assert (args.kv_cache_memory, args.max_num_batched_tokens, args.enable_prefix_caching) == (int(1.5 * 2**30), 128, False)
    assert args.block_size is None  # unset flags keep the dataclass default
    args = build_parser().parse_args(["serve", "m", "--hf-overrides", '{"classifier_from_token": ["no", "yes"]}'])
    assert args.hf_overrides == {"classifier_from_token": ["no", "yes"]}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--hf-overrides", '["no"]'])
    args = build_parser().parse_args(["serve", "m", "--limit-mm-per-prompt", '{"image": 2}', "--encoder-cache-memory",
                                      "64MiB", "--encoder-budget", "512", "--allowed-media-domains",
                                      "upload.wikimedia.org, example.com", "--max-image-pixels", "1000000"])
    assert (args.limit_mm_per_prompt, args.encoder_cache_memory, args.encoder_budget, args.max_image_pixels) == (
        {"image": 2}, 64 * 2**20, 512, 1_000_000)
    from dabba.config import ServerConfig
    assert ServerConfig(allowed_media_domains=args.allowed_media_domains).media_domains == (
        "upload.wikimedia.org", "example.com")


def test_bad_option_exits_with_a_message(checkpoints, capsys) -> None:
    rc = main(["generate", str(checkpoints["qwen2"].path), "--prompt", "x", "--dtype", "int3"])
    assert rc == 2
    assert "dtype must be one of" in capsys.readouterr().err


def test_generate_with_constraints(checkpoints, capsys, tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}}, "required": ["n"]}))
    path = str(checkpoints["qwen2"].path)
    cases = [(["--json-schema", f"@{schema}"], lambda t: 0 <= json.loads(t)["n"] <= 99),
             (["--regex", "[a-c]{4}"], lambda t: len(t) == 4 and set(t) <= set("abc")),
             (["--choice", "up", "--choice", "down"], lambda t: t in ("up", "down")),
             (["--grammar", 'root ::= "x" [0-9]'], lambda t: t[0] == "x" and t[1].isdigit())]
    for flags, check in cases:
        assert main(["generate", path, "--prompt", "Hi", "--max-tokens", "40", "--json", *flags]) == 0
        line = json.loads(capsys.readouterr().out)
        assert line["finish_reason"] == "stop" and check(line["text"]), (flags, line)
    for flags, message in [(["--regex", "a("], "structured_outputs.regex is invalid"),
                           (["--regex", "a", "--choice", "a"], "exactly one of"),
                           (["--json-schema", "@/nonexistent.json"], "cannot read /nonexistent.json")]:
        assert main(["generate", path, "--prompt", "Hi", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_auto_tool_choice_needs_a_parser(checkpoints, capsys) -> None:
    assert main(["serve", str(checkpoints["qwen2"].path), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")


def test_lora_modules_need_enable_lora_and_name_path_items(checkpoints, capsys) -> None:
    path = str(checkpoints["qwen2"].path)
    for flags, message in ((["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
                           (["--enable-lora", "--lora-modules", "a"], "name=path items"),
                           (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice")):
        assert main(["serve", path, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
