"""Shared by the parallel-layout and planner tests: a small model and the layouts it runs on."""

from __future__ import annotations

from meshkit.config import Config, load_config

MODEL = [
    "model.vocab_size=16", "model.d_model=16", "model.num_heads=2", "model.d_ff=16",
    "model.num_layers=2", "model.num_experts=8", "model.top_k=2",
    "model.capacity_factor=4", "model.aux_loss_weight=0",
    "train.batch_size=16", "train.seq_len=8", "train.warmup_steps=5", "train.lr=1e-2",
    "train.steps=20",
]
NO_EXPERTS = ["exchange.node_axis=[]", "exchange.device_axis=[]"]
ONE_DEVICE = ["mesh.axes={dp: 1}", *NO_EXPERTS]
STRATEGIES = {
    "dp8": ["mesh.axes={dp: 8}", *NO_EXPERTS],
    "fsdp8": ["mesh.axes={fsdp: 8}", "parallel.fsdp=fsdp", *NO_EXPERTS],
    "tp2-node2-device2": ["mesh.axes={tp: 2, node: 2, device: 2}", "parallel.tensor=tp"],
    "pp2-node2-device2": ["mesh.axes={pp: 2, node: 2, device: 2}", "parallel.pipeline=pp",
                          "parallel.microbatches=4"],
    "pp2-tp2-node2": ["mesh.axes={pp: 2, tp: 2, node: 2}", "parallel.pipeline=pp",
                      "parallel.tensor=tp", "parallel.microbatches=2",
                      "exchange.device_axis=[]"],
    "fsdp2-node2-device2": ["mesh.axes={fsdp: 2, node: 2, device: 2}", "parallel.fsdp=fsdp"],
    "dp2-pp2-tp2": ["mesh.axes={dp: 2, pp: 2, tp: 2}", "parallel.pipeline=pp",
                    "parallel.tensor=tp", "parallel.microbatches=2", *NO_EXPERTS],
}


def _config(strategy: list[str], *extra: str) -> Config:
    return load_config(None, [*MODEL, *strategy, *extra])
