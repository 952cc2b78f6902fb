"""The models of a server of several models, from --model NAME=PATH flags or a models file (YAML
or JSON): engine flags are every model's defaults, a model's own entries override them, and every
mistake is one ValueError naming the file, the entry and the field."""
from __future__ import annotations

import json

import pytest

from dabba.config_fields import parse_keep_alive
from dabba.entrypoints.cli import main
from dabba.entrypoints.models_file import parse_model_flags, read_models_file
from dabba.entrypoints.openai.model_servings import ServingOptions

YAML = """
keep_alive: 5m
models:
  - name: chat
    model: /models/a
    quantization: int8
    max_model_len: 256
    keep_alive: -1
    tool_call_parser: hermes
  - name: small
    model: /models/b
    lora_modules: {sql: /adapters/sql}
    enable_lora: true
"""


def test_a_yaml_models_file(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(YAML)
    chat, small = read_models_file(str(path), {"dtype": "float32", "max_model_len": 128}, 300.0, ServingOptions())
    assert (chat.spec.name, chat.spec.config.model_config.model, chat.spec.keep_alive) == ("chat", "/models/a", None)
    assert chat.spec.config.model_config.quantization == "int8" and chat.spec.config.model_config.max_model_len == 256
    assert chat.spec.config.model_config.dtype == "float32" and chat.options.tool_call_parser == "hermes"
    assert small.spec.keep_alive == 300.0 and small.spec.config.model_config.max_model_len == 128
    assert small.lora_modules == {"sql": "/adapters/sql"} and small.spec.config.lora_config.enable_lora


def test_model_flags():
    (a,) = parse_model_flags(["a=/models/a"], {"dtype": "bfloat16"}, 60.0, ServingOptions(reasoning_parser="qwen3"))
    assert (a.spec.name, a.spec.config.model_config.model, a.spec.keep_alive) == ("a", "/models/a", 60.0)
    assert a.options.reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_model_flags(["/models/a"], {}, None, ServingOptions())


@pytest.mark.parametrize("content, message", [
    ({"models": []}, "non-empty list 'models'"),
    ({"models": [{"name": "a", "model": "/m"}], "extra": 1}, "unknown top-level keys"),
    ({"models": [{"name": "a", "model": "/m"}, {"name": "a", "model": "/n"}]}, "names must differ"),
    ({"models": [{"model": "/m"}]}, r"models\[0\]: 'name'"),
    ({"models": [{"name": "a", "model": "/m", "max_tokenz": 3}]}, r"models\[0\] \(a\): unknown option"),
    ({"models": [{"name": "a", "model": "/m", "keep_alive": "soon"}]}, r"\(a\): keep_alive must be"),
    ({"models": [{"name": "a", "model": "/m", "tool_call_parser": "nope"}]}, "'tool_call_parser' must be one of"),
    ({"models": [{"name": "a", "model": "/m", "lora_modules": {"x": "/x"}}]}, "needs enable_lora"),
    ({"models": [{"name": "a", "model": "/m", "data_parallel_size": 2}]}, "data_parallel_size"),
])
def test_models_file_mistakes_name_the_entry(tmp_path, content, message):
    path = tmp_path / "models.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        read_models_file(str(path), {}, None, ServingOptions())


def test_unreadable_files_and_the_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="cannot read the models file"):
        read_models_file(str(tmp_path / "none.yaml"), {}, None, ServingOptions())
    (tmp_path / "bad.yaml").write_text("models: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        read_models_file(str(tmp_path / "bad.yaml"), {}, None, ServingOptions())
    assert main(["serve", "some/model", "--model", "a=/m"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "--models-file", str(tmp_path / "bad.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("value, seconds", [(300, 300.0), ("90", 90.0), ("30s", 30.0), ("5m", 300.0),
                                            ("1h", 3600.0), ("-1", None), (-5, None), (0, 0.0), ("250ms", 0.25)])
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", True, None, [1], float("nan"), "inf"])
def test_bad_keep_alive(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
