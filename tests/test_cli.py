"""The dabba command line."""
from __future__ import annotations

import json

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


def test_bad_option_exits_with_a_message(checkpoints, capsys) -> None:
    rc = main(["generate", str(checkpoints["qwen2"].path), "--prompt", "x", "--dtype", "int3"])
    assert rc == 2
    assert "dtype must be one of" in capsys.readouterr().err
