"""One planner: ``meshkit plan CONFIG`` and ``meshkit plan --model FILE`` rank by the same
step model and memory model, so a description of the config's model plans the same."""

from __future__ import annotations

import dataclasses
import json

from meshkit.cli import main
from meshkit.config import load_config
from meshkit.plan.model_desc import ModelDesc


def test_a_config_and_its_description_plan_the_same(tmp_path, capsys) -> None:
    desc = ModelDesc.of_config(load_config(None))
    path = tmp_path / "default.yaml"
    fields = {k: v for k, v in dataclasses.asdict(desc).items() if k != "measured"}
    path.write_text(json.dumps(fields))  # JSON is YAML
    flags = ["--devices", "8", "--top", "1000", "--json"]
    assert main(["plan", *flags]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", str(path), *flags]) == 0
    from_model = json.loads(capsys.readouterr().out)
    assert len(from_config) > 10
    assert from_config == from_model
