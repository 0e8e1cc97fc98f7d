"""XLA temp bytes of meshkit's dp8 train step at issue 36's matched shape.

Usage: python tools/temp_bytes.py [--only 1|8] [--dump DIR]   (8 simulated CPU devices)

The shape: d_model 128, 2 layers, 4 heads, SwiGLU d_ff 512, vocab 512, seq 64, global
batch 32, float32, AdamW, no remat, mesh {dp: 8}; 1 expert (top-1), or 8 experts (top-2,
capacity factor 1.25) replicated. Prints XLA's memory_analysis parts of one device in
MiB. With --dump, XLA writes its buffer assignment there (read it with
tools/temp_peak.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def config(experts: int) -> Any:
    from meshkit.config import Config

    model = dict(d_model=128, num_layers=2, num_heads=4, d_ff=512, vocab_size=512,
                 dtype="float32", remat="none", num_experts=experts,
                 top_k=1 if experts == 1 else 2, capacity_factor=1.25)
    return Config().replace(model=model, mesh={"axes": {"dp": 8}},
                            exchange={"node_axis": [], "device_axis": []},
                            train={"batch_size": 32, "seq_len": 64})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", default=None, help="XLA dump folder (use with --only)")
    parser.add_argument("--only", default=None, choices=("1", "8"), help="one variant only")
    args = parser.parse_args()
    flags = ["--xla_force_host_platform_device_count=8"]
    if args.dump:
        flags += [f"--xla_dump_to={args.dump}", "--xla_dump_hlo_as_text"]
    os.environ["XLA_FLAGS"] = " ".join(flags)

    import jax

    jax.config.update("jax_platforms", "cpu")
    from meshkit.plan.verify import xla_bytes
    from meshkit.training.programs import compile_step

    mib = 2**20
    for experts in (1, 8):
        if args.only and int(args.only) != experts:
            continue
        total, parts = xla_bytes(compile_step(config(experts)).memory_analysis())
        print(f"experts={experts}: temp {parts['temp'] / mib:.2f} MiB  argument "
              f"{parts['argument'] / mib:.2f}  output {parts['output'] / mib:.2f}  alias "
              f"{parts['alias'] / mib:.2f}  total {total / mib:.2f}", flush=True)


if __name__ == "__main__":
    main()
