"""`meshkit config`: the JSON schema editors use, and the resolved config it prints."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from meshkit.cli import main
from meshkit.config import Config, format_reference, json_schema, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema():
    return json_schema()


def _cli_schema(capsys) -> dict:
    assert main(["config", "--schema"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_cli_prints_the_library_schema(capsys):
    printed = _cli_schema(capsys)
    assert printed == json.loads(json.dumps(json_schema()))
    jsonschema.Draft202012Validator.check_schema(printed)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_the_schema_validates_every_shipped_config(path, schema):
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_the_schema_accepts_empty_sections_and_resolved_configs(schema):
    jsonschema.validate({"model": None, "train": {"steps": 5}}, schema)
    for dtype in (None, "uint32"):  # null is a nullable choice's default, not a bad value
        jsonschema.validate({"data": {"dtype": dtype}}, schema)
    jsonschema.validate(load_config(CONFIGS[0]).to_dict(), schema)


@pytest.mark.parametrize(
    "raw",
    [
        {"trian": {"steps": 5}},                      # an unknown section
        {"train": {"stepz": 5}},                      # an unknown key
        {"train": {"num_experts": 8}},                # a key in the wrong section
        {"train": {"steps": "five"}},                 # a string for an int
        {"train": {"steps": 2.5}},                    # a fraction for an int
        {"train": {"lr": True}},                      # a bool for a number
        {"exchange": {"dedup": 1}},                   # an int for a bool
        {"exchange": {"method": "tree"}},             # not one of the choices
        {"data": {"dtype": "float32"}},               # not one of a nullable field's choices
        {"mesh": {"axes": {}}},                       # axes must not be empty
        {"mesh": {"axes": [2, 4]}},                   # axes are a mapping
        {"parallel": {"tensor": 3}},                  # axis names are strings
        {"model": {"num_experts": -1}},               # below the bound
        {"train": 5},                                 # a section is a mapping
    ],
)
def test_the_schema_rejects_what_the_loader_rejects(raw, schema):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, schema)
    with pytest.raises(ValueError):
        Config.from_dict(raw)


def test_the_schema_carries_the_reference_text(schema):
    model = schema["$defs"]["ModelConfig"]["properties"]
    assert model["capacity_factor"]["description"] in format_reference()
    assert model["capacity_factor"]["default"] == 1.25


@pytest.mark.parametrize("path", [None, *CONFIGS], ids=["default", *[p.name for p in CONFIGS]])
def test_config_prints_yaml_that_loads_back_equal(path, tmp_path, capsys):
    overrides = ["train.steps=7", "exchange.method=flat"]
    argv = ["config", *([str(path)] if path else []), *overrides]
    assert main(argv) == 0
    out = capsys.readouterr().out
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out)
    assert load_config(saved) == load_config(path, overrides)
    assert yaml.safe_load(out)["train"]["steps"] == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["config", "train.stepz=1"], "unknown config key 'train.stepz'"),
        (["config", "nope.yaml"], "config file not found: nope.yaml"),
        (["config", "--schema", "train.steps=1"], "--schema takes no config or overrides"),
    ],
)
def test_config_errors_exit_2_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshkit config: error: "), captured.err
    assert message in lines[0] and captured.out == ""

