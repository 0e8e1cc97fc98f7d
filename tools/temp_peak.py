"""The temp buffers live at the peak of one XLA CPU module, from its dumped buffer assignment.

Usage: python tools/temp_peak.py DUMP_DIR [--module jit__train_step] [--min-kib 256]

Reads ``*cpu_after_optimizations-buffer-assignment.txt`` (the preallocated temp
allocation's values: instruction, size, offset), ``*-live-range.txt`` (each value's
live range in the instruction sequence) and ``*cpu_after_optimizations.txt`` (each
instruction's op and ``op_name`` / source line metadata). Prints the temp allocation's
size, the peak of the live bytes (and its time), and each value live at that time of at
least ``--min-kib`` KiB with its op and the JAX op name / source line that made it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re

parser = argparse.ArgumentParser()
parser.add_argument("dump")
parser.add_argument("--module", default="jit__train_step")
parser.add_argument("--min-kib", type=float, default=256)
args = parser.parse_args()


def one(pattern: str) -> str:
    paths = sorted(glob.glob(f"{args.dump}/*{args.module}.{pattern}"))
    if not paths:
        raise SystemExit(f"no {pattern} for {args.module} in {args.dump}")
    return paths[-1]


def read(pattern: str) -> str:
    with open(one(pattern)) as f:
        return f.read()


assignment = read("cpu_after_optimizations-buffer-assignment.txt")
live = read("cpu_after_optimizations-live-range.txt")
hlo = read("cpu_after_optimizations.txt")

# The preallocated temp allocation's values.
block = re.search(r"allocation \d+: size (\d+), preallocated-temp:\n((?: value:.*\n)+)", assignment)
assert block, "no preallocated-temp allocation"
temp_size = int(block.group(1))
values = []
for m in re.finditer(r"value: <\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\): (.*)", block.group(2)):
    name, size, offset, shape = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    index = "{}"
    if name.endswith("}"):
        name, index = name[: name.index("{")], name[name.index("{"):]
    values.append((name, index, size, offset, shape))

ranges = {}
for m in re.finditer(r"^\s+(\S+?)(\{[0-9,]*\}):(\d+)-(\d+)$", live, re.M):
    ranges[(m.group(1), m.group(2))] = (int(m.group(3)), int(m.group(4)))

# The module's stack-frame tables: frame id -> innermost file:line (function).
def table(title: str) -> dict[int, str]:
    m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", hlo, re.M)
    return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in
            (m.group(1).splitlines() if m else [])}


files, functions = table("FileNames"), table("FunctionNames")
locations = {}
for i, text in table("FileLocations").items():
    f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", text)
    if f:
        locations[i] = (f"{files[int(f.group(1))].strip(chr(34)).split('/')[-1]}:{f.group(3)} "
                        f"{functions[int(f.group(2))].strip(chr(34))}")
frames = {i: locations.get(int(re.search(r"file_location_id=(\d+)", t).group(1)), "")
          for i, t in table("StackFrames").items()}

computations: dict[str, list[str]] = {}
current = None
for line in hlo.splitlines():
    head = re.match(r"^%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
        current = head.group(1)
        computations[current] = []
    elif current is not None and line.startswith("  "):
        computations[current].append(line)


def describe(rest: str) -> tuple[str, str]:
    meta = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r"stack_frame_id=(\d+)", rest)
    return (meta.group(1) if meta else ""), (frames.get(int(frame.group(1)), "") if frame else "")


ops = {}
for m in re.finditer(r"^\s*(?:ROOT )?%?(\S+) = (\S+) (\S+?)\((.*)$", hlo, re.M):
    name, rest = m.group(1), m.group(4)
    op_name, src = describe(rest)
    kind = re.search(r"kind=(\w+)", rest)
    calls = re.search(r"calls=%?([\w.\-]+)", rest)
    if calls and not src:  # a fusion without metadata: its first inner op that has some
        for inner in computations.get(calls.group(1), []):
            inner_name, inner_src = describe(inner)
            if inner_src:
                op_name, src = inner_name, inner_src
                break
    ops.setdefault(name, (m.group(3) + (f"[{kind.group(1)}]" if kind else ""),
                          op_name, src, calls.group(1) if calls else ""))

events = collections.Counter()
missing = []
for name, index, size, _, _ in values:
    r = ranges.get((name, index)) or ranges.get((name, "{}"))
    if r is None:
        missing.append(name)
        continue
    events[r[0]] += size
    events[r[1] + 1] -= size
t, cur, peak, peak_t = 0, 0, 0, 0
for t in sorted(events):
    cur += events[t]
    if cur > peak:
        peak, peak_t = cur, t
MIB = 2**20
unranged = f"; {len(missing)} without a live range" if missing else ""
print(f"temp allocation {temp_size / MIB:.2f} MiB; live peak {peak / MIB:.2f} MiB at time "
      f"{peak_t}; {len(values)} values{unranged}")
rows = []
for name, index, size, _offset, shape in values:
    r = ranges.get((name, index)) or ranges.get((name, "{}"))
    if r and r[0] <= peak_t <= r[1]:
        rows.append((size, name, shape, r, ops.get(name, ("?", "", "", ""))))
rows.sort(key=lambda row: -row[0])
small = sum(row[0] for row in rows if row[0] < args.min_kib * 1024)
for size, name, shape, r, (op, op_name, src, _calls) in rows:
    if size < args.min_kib * 1024:
        continue
    print(f"{size / MIB:6.3f} MiB  {name:32s} {shape:28s} live {r[0]}-{r[1]}  {op}  "
          f"{op_name.replace('jit(_train_step)/', '')[-60:]}  {src}")
print(f"{small / MIB:6.3f} MiB  in {sum(1 for row in rows if row[0] < args.min_kib * 1024)} "
      f"smaller values")

# The live bytes at the peak by the source line that made them.
by_source: collections.Counter[str] = collections.Counter()
for size, _name, _shape, _r, (_op, op_name, src, _calls) in rows:
    by_source[src or op_name.split("/")[-1] or "?"] += size
print("by source line:")
for src, size in by_source.most_common():
    print(f"{size / MIB:6.3f} MiB  {src}")
