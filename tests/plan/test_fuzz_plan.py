"""Fuzz `meshkit plan`'s flags and topology files (issue 23).

Each case goes in-process through ``meshkit.cli.main`` and must end in exit 0, or in
exit 2 with exactly one line on stderr and no traceback, within ``CASE_LIMIT_S``. The
generator is seeded: reproduce a failure with ``MESHKIT_FUZZ_SEED=<seed>``, explore with
``MESHKIT_FUZZ_CASES``.
"""

from __future__ import annotations

import os
import random
import time

from meshkit.cli import main

SEED = int(os.environ.get("MESHKIT_FUZZ_SEED", "2323"))
CASES = int(os.environ.get("MESHKIT_FUZZ_CASES", "80"))
CASE_LIMIT_S = 30.0  # a hang bound, not a speed target: the hangs it guards ran past 60 s

DEVICES = ["1", "2", "3", "8", "12", "16", "0", "-8", "1099511627776", "720720",
           str(2**20 + 8), "x", "1e20", "8.0", "9" * 30]
NODES = ["1", "2", "0", "-1", "1" + "0" * 20, "131073", "x"]
TOPS = ["1", "3", "0", "-1", "1000000000000"]
VALUES = ["8", "0", "-1", "1.0e-300", "1.0e300", ".nan", ".inf", "-.inf", str(10**400),
          "x", "[1]", "{a: 1}", "null", "true", "1.0e9", "1.0e12", "3600", "1.0e-6",
          "&a [1, 2]", "'8'", "2024-01-01"]
KEYS = ["devices_per_node", "memory_bandwidth_Bps", "flops_per_s", "memory_bytes",
        "inter.latency_s", "inter.bandwidth_Bps", "intra.latency_s", "intra.bandwidth_Bps"]
BOMB = ("measured:\n  a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
                  for i in range(1, 8)))


def topology_text(rng: random.Random) -> str:
    values = {"devices_per_node": "8", "memory_bandwidth_Bps": "1.0e12",
              "flops_per_s": "1.0e12", "memory_bytes": "85899345920",
              "inter.latency_s": "4.0e-6", "inter.bandwidth_Bps": "5.0e10",
              "intra.latency_s": "1.9e-6", "intra.bandwidth_Bps": "4.5e11"}
    for key in rng.sample(KEYS, rng.randint(0, 2)):
        values[key] = rng.choice(VALUES)
    drop = rng.random() < 0.1 and rng.choice(KEYS)
    lines = [BOMB] if rng.random() < 0.1 else []
    for top in ("devices_per_node", "memory_bandwidth_Bps", "flops_per_s", "memory_bytes"):
        if top != drop:
            lines.append(f"{top}: {values[top]}\n")
    for link in ("inter", "intra"):
        fields = [f"{f}: {values[f'{link}.{f}']}" for f in ("latency_s", "bandwidth_Bps")
                  if f"{link}.{f}" != drop]
        lines.append(f"{link}: {{{', '.join(fields)}}}\n")
    if rng.random() < 0.1:
        lines.append(rng.choice(["1: 2\n", "gpus: 8\n", "? [1]\n: 2\n", "x: 1\n1: 2\n"]))
    rng.shuffle(lines)
    return "".join(lines)


def case_args(rng: random.Random, tmp_path, i: int) -> list[str]:
    args = ["plan"]
    roll = rng.random()
    if roll < 0.4:
        path = tmp_path / f"t{i}.yaml"
        path.write_text(topology_text(rng))
        args += ["--topology", str(path)]
    elif roll < 0.7:
        args += ["--preset", rng.choice(["h100-8x400g", "a100-8x200g", "tpu"])]
        if rng.random() < 0.7:
            args += ["--nodes", rng.choice(NODES)]
    if rng.random() < 0.8:
        args += ["--devices", rng.choice(DEVICES)]
    if rng.random() < 0.5:
        args += ["--top", rng.choice(TOPS)]
    if rng.random() < 0.2:
        args.append(rng.choice(["model.num_experts=3", "model.max_nodes=2",
                                "train.batch_size=7", "mesh.axes={a: 1000000}"]))
    return args


def test_random_plan_flags_and_topology_files_end_in_one_line(tmp_path, capsys):
    rng = random.Random(SEED)
    outcomes = {0: 0, 2: 0}
    for i in range(CASES):
        args = case_args(rng, tmp_path, i)
        start = time.perf_counter()
        try:
            code = main(args)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        seconds = time.perf_counter() - start
        out, err = capsys.readouterr()
        where = f"case {i} (seed {SEED}): meshkit {' '.join(args)}"
        assert code in (0, 2), f"{where}: exit {code}\n{err[-3000:]}"
        assert seconds < CASE_LIMIT_S, f"{where}: {seconds:.1f} s"
        if code == 2:
            assert len(err.strip().splitlines()) == 1, f"{where}:\n{err[-3000:]}"
            assert len(err) < 1000, f"{where}: a {len(err)}-character error"
        else:
            assert out and "Traceback" not in err, where
        outcomes[code] += 1
    assert outcomes[0] and outcomes[2], outcomes  # both paths exercised

