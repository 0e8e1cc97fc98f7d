"""Config overrides shared by the training tests: a model that compiles and steps fast."""

SMALL = [
    "model.d_model=32", "model.num_heads=2", "model.d_ff=32", "model.num_layers=1",
    "train.batch_size=16", "train.seq_len=16", "train.warmup_steps=5", "train.lr=1e-2",
    "train.log_every=5", "train.eval_every=1000", "train.eval_batches=1",
]
