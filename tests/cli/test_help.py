"""Every command's help: a description, examples that parse, and no reST markup."""

import importlib
import re
import shlex

import pytest

cli = importlib.import_module("meshkit.cli.main")
commands = cli.commands

RST = re.compile(r"``|:(func|class|mod|data|meth|attr):")


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.main([*args, "--help"])
    assert ended.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command_in_plain_text(capsys):
    text = _help(capsys)
    assert not RST.search(text), text
    listed = re.findall(r"^    (\w+) {2,}", text, flags=re.M)
    assert listed == list(commands())


@pytest.mark.parametrize("command", commands())
def test_each_command_has_a_description_and_examples_that_parse(command, capsys):
    text = _help(capsys, command)
    assert not RST.search(text), text
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 15, f"{command}: no description: {description!r}"
    examples = re.findall(r"^  \$ (.+)$", text.split("examples:")[1], flags=re.M)
    assert examples, f"meshkit {command} --help shows no example"
    parser = cli._parser()
    for example in examples:
        argv = shlex.split(example)
        assert argv[:2] == ["meshkit", command], example
        parser.parse_args(argv[1:])  # a usage error exits 2, failing the test


def test_link_rate_help_describes_each_process_its_own_link(capsys):
    text = " ".join(_help(capsys, "launch").split())
    assert "own network namespace and a virtual NIC shaped to RATE" in text
    assert "loopback is rate-limited" not in text


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["--version"])
    assert ended.value.code == 0
    assert re.fullmatch(r"meshkit \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
