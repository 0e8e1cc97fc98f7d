"""Fuzz ``meshkit calibrate``'s and the benchmarks' arguments and topology files (issue 23).

``meshkit plan``'s flags and topology files have their own fuzz test
(tests/plan/test_fuzz_plan.py). Here every case goes in-process through the command
line's boundary, ``meshkit.cli.main`` for calibrate (its measurements replaced by a
fixed result, so a valid case only writes its file) and ``meshkit.cli.script.run`` over
each benchmark's ``parse_args`` (everything a benchmark checks before it measures). Each
must end in exit 0, or exit 2 with exactly one short line on stderr and no traceback,
within ``CASE_LIMIT_S``. Seeded: reproduce with ``MESHKIT_FUZZ_SEED=<seed>``, explore
with ``MESHKIT_FUZZ_CASES``.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from pathlib import Path

import pytest

import meshkit.plan.calibrate as calibrate_module
from meshkit.cli import main
from meshkit.cli.script import run

SEED = int(os.environ.get("MESHKIT_FUZZ_SEED", "2324"))
CASES = int(os.environ.get("MESHKIT_FUZZ_CASES", "60"))
CASE_LIMIT_S = 3.0

COUNTS = ["1", "3", "0", "-1", "x", "1.5", "1e3", "", "99999999999999999999", "٣"]
OVERRIDES = ["model.d_model=64", "model.d_model=x", "model.num_experts=3", "train.stepz=1",
             "mesh.axes={a: 1000000}", "train.batch_size=0", "model.top_k=99",
             "exchange.method=nope", "[1, 2]", "=", "model.d_model=&a [*a]"]
TOPOLOGY = ("devices_per_node: {dpn}\nmemory_bandwidth_Bps: {mem}\nflops_per_s: {flops}\n"
            "memory_bytes: 85899345920\ninter: {{latency_s: 4.0e-6, bandwidth_Bps: 5.0e10}}\n"
            "intra: {{latency_s: 1.9e-6, bandwidth_Bps: {bw}}}\n")
TOPOLOGY_VALUES = ["8", "0", "-1", ".nan", ".inf", "1.0e-300", "1.0e300", "x", "[1]",
                   str(10**400), "1.0e12"]
BOMB = ("a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 8)))


def _topology_file(rng: random.Random, folder: Path, i: int) -> str:
    roll = rng.random()
    path = folder / f"t{i}.yaml"
    if roll < 0.1:
        return str(folder / "missing.yaml")
    if roll < 0.2:
        path.write_text(BOMB)
    elif roll < 0.3:
        path.write_text(rng.choice(["", "a: [", "[1, 2]", "{1: 2}", "\x00"]))
    else:
        values = {"dpn": "8", "mem": "1.0e12", "flops": "1.0e12", "bw": "4.5e11"}
        for key in rng.sample(sorted(values), rng.randint(0, 2)):
            values[key] = rng.choice(TOPOLOGY_VALUES)
        path.write_text(TOPOLOGY.format(**values))
    return str(path)


def _path(rng: random.Random, folder: Path, i: int, suffix: str) -> str:
    return rng.choice([str(folder / f"out{i}{suffix}"), str(folder),
                       str(folder / "no" / f"x{suffix}"), f"/proc/x{suffix}",
                       str(folder / f"out{i}.json"), suffix, ""])


def _bench_args(rng: random.Random, name: str, folder: Path, i: int) -> list[str]:
    flags = {"groups": ["--repeats"], "exchange": ["--repeats"], "moe": ["--repeats"],
             "parallel": ["--steps"], "train": ["--steps", "--loop-steps", "--loop-repeats"],
             "plan": ["--steps"]}[name]
    args: list[str] = []
    for flag in flags:
        if rng.random() < 0.5:
            args += [flag, rng.choice(COUNTS)]
    if rng.random() < 0.3:
        args.append("--quick")
    if name == "plan":
        if rng.random() < 0.6:
            args += ["--topology", _topology_file(rng, folder, i)]
        if rng.random() < 0.3:
            args += ["--processes", rng.choice(["1", "2", "3", "x"])]
    if rng.random() < 0.3:  # every benchmark's report (meshkit.benchmarks._report)
        args += ["--json", rng.choice(["-", _path(rng, folder, i, ".json")])]
    if name in ("parallel", "train", "plan") and rng.random() < 0.5:
        args += rng.sample(OVERRIDES, rng.randint(1, 2))
    if rng.random() < 0.1:
        args.append(rng.choice(["--no-such-flag", "-x", "--steps", "--help=1"]))
    if rng.random() < 0.1:
        rng.shuffle(args)
    return args


def _check(code: object, err: str, seconds: float, where: str) -> int:
    assert code in (0, 2), f"{where}: exit {code}\n{err[-3000:]}"
    assert seconds < CASE_LIMIT_S, f"{where}: {seconds:.1f} s"
    if code == 2:
        assert len(err.strip().splitlines()) == 1, f"{where}:\n{err[-3000:]}"
        assert len(err) < 1000, f"{where}: a {len(err)}-character error"
    assert "Traceback" not in err, where
    return int(code)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def benches():
    return {name: importlib.import_module(f"meshkit.benchmarks.bench_{name}")
            for name in ("groups", "exchange", "moe", "parallel", "train", "plan")}


def test_random_benchmark_arguments_end_in_one_line(benches, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --json path lands here
    rng = random.Random(SEED)
    outcomes = {0: 0, 2: 0}
    for i in range(CASES):
        name = rng.choice(sorted(benches))
        args = _bench_args(rng, name, tmp_path, i)
        parse_args = benches[name].parse_args
        start = time.perf_counter()
        code = run(lambda argv, parse=parse_args: 0 if parse(argv) else 1, name, args)
        _, err = capsys.readouterr()
        where = f"case {i} (seed {SEED}): meshkit bench {name} {' '.join(args)}"
        outcomes[_check(code, err, time.perf_counter() - start, where)] += 1
        if code == 2:
            assert err.startswith(f"meshkit bench {name}: error: "), f"{where}: {err}"
    assert outcomes[0] and outcomes[2], outcomes  # both paths exercised


def test_random_calibrate_arguments_end_in_one_line(tmp_path, capsys, monkeypatch):
    link = {"latency_s": 2e-6, "bandwidth_Bps": 5e10}
    measured = {"devices_per_node": 8, "intra": dict(link), "memory_bandwidth_Bps": 1e11,
                "flops_per_s": 1e12, "memory_bytes": None, "measured": {"intra": []}}
    monkeypatch.setattr(calibrate_module, "calibrate", lambda **kwargs: dict(measured))
    rows = [{"op": "collective-permute", "group": 2, "bytes": b, "seconds": 1e-5 + b / 1e9}
            for b in (1e3, 1e6)]
    monkeypatch.setattr(calibrate_module, "_measure_inter", lambda sizes, repeats, **link: rows)
    monkeypatch.chdir(tmp_path)  # a relative path (".yaml") lands here, not in the checkout
    rng = random.Random(SEED + 1)
    outcomes = {0: 0, 2: 0}
    for i in range(CASES // 2):
        args = ["calibrate"]
        if rng.random() < 0.8:
            args += [rng.choice(["-o", "--output"]), _path(rng, tmp_path, i, ".yaml")]
        if rng.random() < 0.5:
            args += ["--processes", rng.choice(["1", "2", "0", "3", "x", "-1"])]
        if rng.random() < 0.3:
            args.append("--quick")
        if rng.random() < 0.1:
            args.append(rng.choice(["--no-such-flag", "extra", "-o"]))
        if "-o" not in args and "--output" not in args:
            args += ["-o", str(tmp_path / f"default{i}.yaml")]  # not the current directory
        start = time.perf_counter()
        try:
            code = main(args)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        out, err = capsys.readouterr()
        where = f"case {i} (seed {SEED + 1}): meshkit {' '.join(args)}"
        outcomes[_check(code, err, time.perf_counter() - start, where)] += 1
        if code == 0:
            assert out.splitlines()[-1].startswith("wrote "), where
    assert outcomes[0] and outcomes[2], outcomes
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, leftovers  # no half-written topology file anywhere
