"""The accepted values of meshkit's enumerated settings, each listed once.

The config validator, the CLI and the library functions that take these settings all
read them from here, so they cannot disagree. No imports: every module, JAX-free ones
included, may use it.

Examples:
    >>> "hierarchical" in EXCHANGE_METHODS, DATA_KINDS[0]
    (True, 'markov')
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_KINDS",
    "BATCH_ROLES",
    "BENCHMARKS",
    "CONTEXT_METHODS",
    "DATA_KINDS",
    "DISPATCH_MODES",
    "DTYPES",
    "EXCHANGE_METHODS",
    "EXCHANGE_ORDERS",
    "LINK_BURST_UNITS",
    "LINK_RATE_UNITS",
    "LOGICAL_AXES",
    "MLP_KINDS",
    "MOE_TENSOR_MODES",
    "PIPELINE_SCHEDULES",
    "PIPELINE_SCHEDULES_BUILT",
    "REMAT_POLICIES",
    "ROLES",
    "TOKEN_DTYPES",
]

#: How the expert exchange runs: ``auto`` asks the cost model, ``flat`` is one
#: all-to-all over all expert devices, ``hierarchical`` the two-stage exchange.
EXCHANGE_METHODS: tuple[str, ...] = ("auto", "flat", "hierarchical")
#: Which stage of the two-stage exchange runs first.
EXCHANGE_ORDERS: tuple[str, ...] = ("node_first", "device_first")
#: How tokens are placed into expert buffers: a stable sort or one-hot einsums.
DISPATCH_MODES: tuple[str, ...] = ("sort", "einsum")
#: Compute dtypes.
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: Training data sources: a synthetic Markov chain, a byte-level text file, a token file.
DATA_KINDS: tuple[str, ...] = ("markov", "text", "tokens")
#: Integer types of a token file's ids (``data.dtype``); a raw file's are little-endian.
TOKEN_DTYPES: tuple[str, ...] = (
    "uint16", "uint32", "int32", "int64", "uint64", "int16", "uint8", "int8")
#: What a mesh axis can do, one role per axis: ``data`` splits the batch (gradients are
#: all-reduced over it), ``fsdp`` splits the batch and shards parameters and optimizer
#: state, ``tensor`` splits attention heads and the vocabulary (Megatron), ``pipeline``
#: splits the layers into stages, ``expert`` splits the experts (and the batch),
#: ``context`` splits each sequence (attention exchanges K/V over it; the batch's rows
#: are not split, so a context axis is no batch axis).
ROLES: tuple[str, ...] = ("data", "fsdp", "tensor", "pipeline", "expert", "context")
#: The roles whose axes split the batch (each device of them gets its own rows).
BATCH_ROLES: tuple[str, ...] = ("data", "fsdp", "expert")
#: How attention crosses the context axes (``parallel.context_method``): ``all_gather``
#: gathers K and V over them, ``ring`` passes K/V blocks round the group (online
#: softmax), ``ulysses`` trades sequence shards for head shards by all-to-all,
#: ``hierarchical`` is Ulysses over the last (inner) context axis and a ring over the
#: others; ``auto`` asks the cost model.
CONTEXT_METHODS: tuple[str, ...] = ("auto", "all_gather", "ring", "ulysses", "hierarchical")
#: Pipeline schedules (``parallel.schedule``): ``gpipe`` runs every microbatch's forward
#: pass, then autodiff runs the backward passes; ``1f1b`` runs one forward and one
#: backward microbatch per stage each tick, so a stage keeps at most S microbatches'
#: inputs; ``interleaved`` gives each device ``parallel.virtual_stages`` non-adjacent
#: chunks of layers (circular), shrinking the bubble.
PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
#: The schedules meshkit's transformer runs today (the planner still models the rest;
#: ``--verify`` and ``--runnable`` keep to these).
PIPELINE_SCHEDULES_BUILT: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
#: Activation checkpointing of each block (``model.remat``): ``none`` keeps every
#: activation for the backward pass, ``full`` recomputes the block, ``save_dots`` keeps
#: the matmul outputs and recomputes the rest.
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "save_dots")
#: Attention implementations (``model.attention``): ``xla`` materialises the scores,
#: ``dot_product`` is ``jax.nn.dot_product_attention`` (cuDNN on GPU where available),
#: ``chunked`` is blockwise with an online softmax, linear in T on every backend.
ATTENTION_KINDS: tuple[str, ...] = ("xla", "dot_product", "chunked")
#: What ``meshkit bench NAME`` runs: the module ``meshkit.benchmarks.bench_NAME``.
BENCHMARKS: tuple[str, ...] = ("groups", "exchange", "train", "parallel", "moe", "plan",
                               "plan_memory", "memory", "memory_block", "memory_pipeline",
                               "peer", "context")
#: Feed-forward blocks of dense layers (``model.mlp``, and a planner model description's
#: ``mlp:``): ``swiglu`` is three matrices (gate, up, down) with a SiLU gate, ``gelu``
#: two (up, down).
MLP_KINDS: tuple[str, ...] = ("swiglu", "gelu")
#: What the tensor axes split in an MoE layer (``parallel.moe_tensor``): ``tokens``, each
#: tensor rank routes and runs its own slice of the tokens with whole experts; ``ffn``,
#: each expert's hidden width is split over the tensor ranks (expert tensor parallelism,
#: one all-reduce after the combine); ``auto`` asks the cost model.
MOE_TENSOR_MODES: tuple[str, ...] = ("auto", "tokens", "ffn")
#: The logical dimension names meshkit's sharding rules know without being told: what
#: a parameter's or an activation's dimension *is* (:mod:`meshkit.sharding.rules` maps
#: each to the mesh axes of a role); a model adds its own with ``parallel.logical_axes``.
LOGICAL_AXES: tuple[str, ...] = ("layers", "vocab", "heads", "embed", "mlp", "experts",
                                 "expert_mlp", "batch", "tokens", "sequence", "kv_heads")
#: Units of a shaped link's rate (``meshkit launch --link-rate``), as ``tc`` spells
#: them: bits per second, times the unit's factor (decimal, as tc's rates are).
LINK_RATE_UNITS: tuple[str, ...] = ("kbit", "mbit", "gbit", "tbit")
#: Units of a shaped link's burst (``--link-burst``), as ``tc`` spells them: bytes, times
#: 1024 per step (tc's sizes are binary).
LINK_BURST_UNITS: tuple[str, ...] = ("b", "kb", "mb")
