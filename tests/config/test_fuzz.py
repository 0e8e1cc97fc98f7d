"""Fuzz `meshkit train` and `meshkit mesh` with malformed configs and overrides.

Each case goes in-process through ``meshkit.cli.main``, the console script's entry point,
and must end either in success or in exit code 2 with exactly one line on stderr
(``meshkit train: error: ...``) and no traceback.

The generator is seeded. A failure names its case and the seed; reproduce it with
``MESHKIT_FUZZ_SEED=<seed> pytest tests/config/test_fuzz.py``, and explore further with another
seed or more cases (``MESHKIT_FUZZ_CASES``).

Valid configs would compile and train, which costs seconds each, so the generator is
biased towards invalid input, and only the first ``REAL_RUNS`` valid small configs
train for real (1 step). Every other valid config runs every check of ``meshkit train``
and stops where compilation would begin (``meshkit.training.loop.Programs``); the test counts
those as valid.
"""

from __future__ import annotations

import io
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

import meshkit.training.loop as train_module
from meshkit.cli import main
from meshkit.config import all_keys

SEED = int(os.environ.get("MESHKIT_FUZZ_SEED", "1303"))
CASES = int(os.environ.get("MESHKIT_FUZZ_CASES", "300"))
REAL_RUNS = 2
DEFAULT_YAML = (Path(__file__).resolve().parents[2] / "configs" / "default.yaml").read_text()

# A tiny model and one step: the base every case starts from (first, so cases override it).
TINY = [
    "model.d_model=16", "model.num_heads=2", "model.d_ff=16", "model.num_layers=1",
    "train.batch_size=8", "train.seq_len=8", "train.steps=1", "train.warmup_steps=0",
    "train.eval_batches=1",
]
# Paths are fuzzed by dedicated tests (test_errors.py): a random workdir could be "/".
KEYS = [k for k in all_keys() if k != "train.workdir"]

VALUES = [
    "0", "-1", "1", "2", "3", "7", "8", "16", "2147483648", "4294967296", "18446744073709551615",
    "1e300", "-1e-300", "1.5", "7.0", "0.0", "-0.0", ".nan", ".inf", "-.inf", "1e3", "3e-4",
    "99999999999999999999999", "1" + "0" * 400, "9" * 5000,
    "true", "false", "yes", "null", "~", "''", '""', "x", "'8'", "node", "device", "auto",
    "[]", "{}", "[1, 2]", "[[0, 1], [2, 3]]", "{a: 1}", "{node: 2, device: 4}", "[node]",
    "2024-13-01", "2024-01-01", "0x10", "0o17", "1_000", "12:30:00",
    "!!binary aGVsbG8=", "!!python/object/apply:os.system [ls]", "!!str 5", "!!int x",
    "&a 1", "*a", "{", "[", "'", '"', "\t1", "a: b: c", "- 1", "? x", "|", ">", "%YAML 1.1",
    "--- 5", "1 # comment", "ünïcödé", "\x00", "\x85", "a\nb", "{node: 2, node: 4}",
    "[" * 300 + "]" * 300, "{a: " * 50 + "1" + "}" * 50, "  ", "=", "a=b",
]
RANK_ATOMS = ["0", "1", "2", "3", "7", "7.0", "-1", "8", "18446744073709551615", "2**64",
              "1e300", "'3'", "null", "true", "[]", "{}", ".nan"]


class _ReachedCompile(BaseException):
    """Raised where ``meshkit train`` would start compiling: the config passed every check.

    A ``BaseException`` so that no ``except Exception`` on the way can swallow it.
    """


def _bad_value(rng: random.Random) -> tuple[str | None, list[str]]:
    return None, [f"{rng.choice(KEYS)}={rng.choice(VALUES)}"
                  for _ in range(rng.choice([1, 1, 1, 2, 3]))]


def _typo(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return rng.choice([
        key[:i] + key[i + 1:],                                        # delete
        key[:i] + rng.choice("abcxyz._-Z0ü ") + key[i:],              # insert
        key[:i] + key[i:].upper(),                                     # case
        key + rng.choice([".x", ".0", ".", ".steps", ".node.x"]),      # too deep
        rng.choice(["", "x.", "mesh.axes.", "train.train."]) + key,    # wrong prefix
        key.split(".")[-1],                                            # no section
        key.replace(".", rng.choice(["..", ":", "/", ". "])),         # bad separator
    ])


def _unknown_key(rng: random.Random) -> tuple[str | None, list[str]]:
    key = _typo(rng, rng.choice([*KEYS, "mesh.axes.node", "mesh.axes.device"]))
    item = f"{key}={rng.choice(['1', '8', 'x', 'null'])}"
    return None, [rng.choice([item, key, f" {item}", item.replace("=", " = ")])]


def _nested(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.15:
        return rng.choice(RANK_ATOMS)
    items = [_nested(rng, depth - 1) for _ in range(rng.choice([0, 1, 2, 2, 4]))]
    return "[" + ", ".join(items) + "]"


def _ranks(rng: random.Random) -> tuple[str | None, list[str]]:
    shape = rng.choice([(2, 4), (4, 2), (8,), (2, 2, 2), (1, 8)])
    ids = list(range(8))
    rng.shuffle(ids)
    text = repr(_reshape(ids, shape))
    broken = rng.choice([
        lambda t: t.replace(str(ids[0]), rng.choice(RANK_ATOMS), 1),   # a bad id
        lambda t: t.replace(str(ids[1]), str(ids[2]), 1),              # a duplicate
        lambda t: t.replace("], [", "], [[", 1) + "]",                  # ragged depth
        lambda t: t.replace(", " + str(ids[3]), "", 1),                 # ragged length
        lambda t: "[" + t + "]",                                        # one level too deep
        lambda t: t,                                                    # maybe fine
        lambda t: _nested(rng, rng.choice([1, 2, 3, 6])),               # anything
    ])(text)
    axes = rng.choice(["{node: 2, device: 4}", "{node: -1, device: 4}", "{node: 4, device: 2}",
                       "{node: -1, device: -1}", "{a: 8}", "{node: 2, device: 2, x: 2}",
                       "{node: 2, device: 4.5}", "{node: 0, device: 8}"])
    return None, [f"mesh.axes={axes}", f"mesh.ranks={broken}"]


def _reshape(flat: list[int], shape: tuple[int, ...]) -> list:
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_reshape(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _axes(rng: random.Random) -> tuple[str | None, list[str]]:
    sizes = ["1", "2", "4", "8", "-1", "0", "-3", "2.0", "2.5", "'2'", "null", "[2]",
             "4294967296", "1099511627776", "true"]
    names = ["node", "device", "x", "''", "1", "null", "node"]
    pairs = [f"{rng.choice(names)}: {rng.choice(sizes)}" for _ in range(rng.choice([0, 1, 2, 3]))]
    items = [f"mesh.axes={{{', '.join(pairs)}}}"]
    if rng.random() < 0.3:
        items.append(f"mesh.axes.{rng.choice(['node', 'device', 'gpu'])}={rng.choice(sizes)}")
    return None, items


_YAML_JUNK = ["\t", ":", "{", "}", "[", "]", "-", "'", '"', "&", "*", "!", "|", ">", "%", "@",
              "`", "#", ",", "\n", " ", "  ", "\x00", "\ufeff", "x"]


def _mutate_line(rng: random.Random, line: str) -> list[str]:
    j = rng.randrange(len(line) + 1)
    kind = rng.randrange(8)
    if kind == 0:
        return [line[:j] + rng.choice(_YAML_JUNK) + line[j:]]          # insert junk
    if kind == 1:
        return [line[:j] + line[j + 1:]]                                # delete a char
    if kind == 2:
        return [line, line]                                             # duplicate key
    if kind == 3:
        return []                                                       # drop the line
    if kind == 4:
        return [line[:j]]                                               # cut mid-line
    if kind == 5:
        return [line.lstrip()]                                          # lose the indent
    if kind == 6:
        return ["  " + line]                                            # extra indent
    return [line.split(":")[0] + ": " + rng.choice(VALUES) + "\n"]      # a bad value


def _broken_yaml(rng: random.Random) -> tuple[str | None, list[str]]:
    lines = DEFAULT_YAML.splitlines(keepends=True)
    for _ in range(rng.choice([1, 1, 2, 3])):
        i = rng.randrange(len(lines))
        lines[i:i + 1] = _mutate_line(rng, lines[i])
    text = "".join(lines)
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]                         # truncated file
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.08:
        k = rng.randrange(len(data))
        data = data[:k] + rng.choice([b"\xff", b"\xfe\xff", b"\xc3", b"\x80\x80"]) + data[k:]
    return data.decode("latin-1"), []  # bytes smuggled through latin-1, written back as bytes


_SIZES = {
    "model.d_model": ["16", "1024", "16384", "1048576"],
    "model.num_heads": ["1", "2", "8", "1024"],
    "model.d_ff": ["16", "65536", "2147483647"],
    "model.num_layers": ["1", "1000", "2147483647"],
    "model.num_experts": ["8", "16", "1048576", "2147483640"],
    "model.vocab_size": ["2", "256", "65536", "1048576", "2147483647"],
    "model.capacity_factor": ["1e-300", "0.001", "1e10", "1e300"],
    "train.batch_size": ["8", "1048576", "2147483640"],
    "train.seq_len": ["1", "8", "65536", "2147483647"],
    "train.eval_batches": ["1", "2147483647"],
    "data.order": ["1", "5", "64", "2147483647"],
    "data.concentration": ["1e-300", "1e300"],
    "data.seed": ["0", "4294967295"],
}


def _sizes(rng: random.Random) -> tuple[str | None, list[str]]:
    """Large values of the right type: the memory and data checks must catch them."""
    keys = rng.sample(sorted(_SIZES), rng.choice([1, 2, 3, 4]))
    return None, [f"{k}={rng.choice(_SIZES[k])}" for k in keys]


def _data(rng: random.Random) -> tuple[str | None, list[str]]:
    """File data sources pointing at odd files (made in the current directory)."""
    files = {"empty.bin": b"", "one.bin": b"\x01", "odd.bin": b"\x01\x02\x03",
             "big_ids.bin": b"\xff\xff" * 64, "text.txt": "héllo wörld\n".encode() * 20,
             "binary.txt": bytes(range(256)) * 4, "raw.npy": b"\x01\x00" * 64,
             **{f"{dtype}.npy": _npy(np.arange(-8, 120).astype(dtype)) for dtype in
                ("uint16", "int32", "uint32", "float32")},
             "two_d.npy": _npy(np.zeros((4, 32), dtype=np.int32)),
             "cut.npy": _npy(np.arange(64, dtype=np.int32))[:90]}
    for name, content in files.items():
        Path(name).write_bytes(content)
    Path("a_dir").mkdir(exist_ok=True)
    path = rng.choice([*files, "a_dir", "missing.bin", "/dev/null", "''", "~"])
    return None, [f"data.kind={rng.choice(['text', 'tokens'])}", f"data.path={path}",
                  f"model.vocab_size={rng.choice(['16', '256', '65536', '65537'])}",
                  f"train.seq_len={rng.choice(['4', '8', '64', '100000'])}",
                  f"data.dtype={rng.choice(['null', 'uint16', 'uint32', 'int8', 'float32'])}"]


def _npy(array: np.ndarray) -> bytes:
    """``array`` as the bytes of a ``.npy`` file."""
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


# Valid values only: these cases are meant to pass, and a few of them train for real.
_VALID = {
    "exchange.method": ["auto", "flat", "hierarchical"],
    "exchange.order": ["node_first", "device_first"],
    "model.top_k": ["1", "2"],
    "model.num_experts": ["8", "16"],
    "model.dispatch": ["sort", "einsum"],
    "model.capacity_factor": ["0.5", "1", "2.0"],
    "data.order": ["1", "2"],
    "data.concentration": ["0.1", "1"],
    "train.lr": ["1e-3", "0.1"],
    "train.seed": ["0", "4294967295"],
    "mesh.axes": ["{node: 2, device: 4}", "{node: 4, device: 2}", "{node: 1, device: 8}"],
}


def _valid(rng: random.Random) -> tuple[str | None, list[str]]:
    keys = rng.sample(sorted(_VALID), rng.choice([1, 2, 3]))
    return None, [f"{k}={rng.choice(_VALID[k])}" for k in keys]


GENERATORS: list[tuple[str, Callable[[random.Random], tuple[str | None, list[str]]], int]] = [
    ("bad value", _bad_value, 40),
    ("unknown key", _unknown_key, 12),
    ("mesh.ranks", _ranks, 18),
    ("mesh.axes", _axes, 10),
    ("broken YAML file", _broken_yaml, 15),
    ("large sizes", _sizes, 10),
    ("file data", _data, 6),
    ("valid", _valid, 5),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run main(argv); return (outcome, detail) where outcome is ok/valid/rejected/FAIL."""
    command = argv[0]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    except _ReachedCompile:
        capsys.readouterr()
        return "valid", ""
    except BaseException as e:  # anything else escaping main is a finding
        err = capsys.readouterr().err
        return "FAIL", f"{type(e).__name__} escaped main: {e!r}\n{err[-2000:]}"
    err = capsys.readouterr().err
    if code == 0:
        return "ok", ""
    lines = err.strip().splitlines()
    if (code == 2 and len(lines) == 1 and lines[0].startswith(f"meshkit {command}: error: ")
            and "Traceback" not in err):
        return "rejected", lines[0]
    return "FAIL", f"exit code {code}, stderr:\n{err[-3000:]}"


def test_fuzz_configs_and_overrides(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative paths in fuzzed values land here
    real = train_module.Programs
    runs = {"real": 0}

    def programs(config, mesh, **model):
        if runs["real"] < REAL_RUNS and runs.get("allow_real"):
            runs["real"] += 1
            return real(config, mesh, **model)
        raise _ReachedCompile

    monkeypatch.setattr(train_module, "Programs", programs)
    rng = random.Random(SEED)
    names = [name for name, _, _ in GENERATORS]
    weights = [w for _, _, w in GENERATORS]
    outcomes: Counter[tuple[str, str, str]] = Counter()
    failures = []
    start = time.perf_counter()
    for case in range(CASES):
        name = rng.choices(names, weights)[0]
        text, overrides = dict((n, g) for n, g, _ in GENERATORS)[name](rng)
        items = list(overrides)
        if text is not None:
            path = tmp_path / f"case{case}.yaml"
            path.write_bytes(text.encode("latin-1"))
            items = [str(path), *items]
        workdir = f"train.workdir={tmp_path / f'run{case}'}"
        # The tiny base comes first, so that a case's own overrides win.
        train_items = ([items[0]] if text is not None else []) + [workdir, *TINY] + (
            items[1:] if text is not None else items)
        runs["allow_real"] = name == "valid"
        for argv in (["mesh", *items], ["train", *train_items, "--no-progress"]):
            outcome, detail = _run(argv, capsys)
            outcomes[(argv[0], name, outcome)] += 1
            if outcome == "FAIL":
                failures.append(f"case {case} ({name}): meshkit {' '.join(map(repr, argv))}\n"
                                f"{detail}")
    seconds = time.perf_counter() - start
    summary = ", ".join(f"{c} {n} {o}: {k}" for (c, n, o), k in sorted(outcomes.items()))
    print(f"\nfuzz seed {SEED}: {CASES} cases ({2 * CASES} runs) in {seconds:.1f} s, "
          f"{runs['real']} trained for real; {summary}")
    assert not failures, (
        f"{len(failures)} of {2 * CASES} fuzz runs failed (seed {SEED}; reproduce with "
        f"MESHKIT_FUZZ_SEED={SEED}):\n\n" + "\n\n".join(failures[:10])
    )
    # The generator must reach both ends, or the test proves nothing.
    assert runs["real"] == REAL_RUNS
    train: Counter[str] = Counter()
    for (command, _, outcome), k in outcomes.items():
        train[outcome] += k if command == "train" else 0
    assert train["rejected"] > CASES / 2 and train["valid"] > 0, outcomes


# ------------------------------------------- every rejection names its dotted key

# Values of every kind; a case uses one that the key's JSON schema rejects, so the loader
# must reject it too, naming the key.
WRONG = ["abc", "''", "true", "2", "-3", "2.5", "1e400", "[1, 2]", "[x, x]", "{a: 1}", "{}",
         "[[0, x]]", "[5, 1]", "null"]


def _named_case(rng: random.Random, schema: dict) -> tuple[dict, str, str, str]:
    """A config dict with one fault, the key it must name, how the message names it, and
    the kind of fault."""
    raw = {s: {} for s in schema["properties"]}
    sections = {s: schema["$defs"][ref["$ref"].split("/")[-1]]["properties"]
                for s, p in schema["properties"].items() for ref in p["anyOf"][:1]}
    section = rng.choice(list(sections))
    # Not train.workdir: the train command's own workdir item would override the fault.
    key = rng.choice([k for k in sections[section] if f"{section}.{k}" != "train.workdir"])
    kind = rng.choice(["bad type", "bad type", "unknown key", "unknown section", "wrong section"])
    if kind == "bad type":
        values = [yaml.safe_load(v) for v in WRONG]
        bad = [v for v in values if not _valid(v, sections[section][key], schema)]
        raw[section][key] = rng.choice(bad)
        return raw, f"{section}.{key}", "starts", kind
    if kind == "unknown key":
        name = rng.choice([key + "s", key[:-1], "x" + key, key.upper(), "zzz"])
        raw[section][name] = 1
        return raw, f"{section}.{name}", "unknown", kind
    if kind == "unknown section":
        name = rng.choice([section + "s", section[:-1], "optimizer", "x"])
        raw[name] = {key: 1}
        return raw, name, "unknown", kind
    other = rng.choice([s for s in sections if key not in sections[s]])
    raw[other][key] = 1
    return raw, f"{other}.{key}", "unknown", kind


def _valid(value: object, prop: dict, schema: dict) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator({**prop, "$defs": schema["$defs"]}).is_valid(value)


def test_fuzz_every_rejection_names_its_key(tmp_path, monkeypatch, capsys):
    """Bad types, unknown keys and sections, keys in the wrong section: in a file and as
    overrides, ``meshkit mesh`` and ``meshkit train`` exit 2 naming the dotted key."""
    from meshkit.config import json_schema

    def refuse(*args, **kwargs):
        raise AssertionError("compiled a config that should have been rejected")

    monkeypatch.setattr(train_module, "Programs", refuse)
    schema = json_schema()
    rng = random.Random(SEED)
    failures, kinds, sections = [], Counter(), set()
    for case in range(200):
        raw, key, how, kind = _named_case(rng, schema)
        kinds[kind] += 1
        if kind == "unknown key":
            sections.add(key.split(".")[0])
        path = tmp_path / f"named{case}.yaml"
        path.write_text(yaml.safe_dump(raw))
        overrides = [f"{s}.{k}={json.dumps(v)}"  # JSON is YAML
                     for s, keys in raw.items() for k, v in (keys or {}).items()]
        for items in ([str(path)], overrides):
            for argv in (["mesh", *items],
                         ["train", *items, f"train.workdir={tmp_path}", "--no-progress"]):
                code = main(argv)
                err = capsys.readouterr().err.strip()
                line = err.split("error: ", 1)[-1]
                named = line.startswith(tuple(
                    f"unknown config key '{key}{end}" if how == "unknown" else f"{key}{end}"
                    for end in ("'", ".", ":", "[")))
                if code != 2 or "\n" in err or not named:
                    failures.append(f"case {case}: {argv} -> {code}: {err[-500:]} "
                                    f"(expected {key!r})")
    assert not failures, "\n".join(failures[:10])
    assert min(kinds.values()) > 20 and len(kinds) == 4, kinds
    assert sections == set(schema["properties"])  # an unknown key in every section
