"""The config's sections as frozen pydantic models, and :class:`Config`, the whole run.

A field's ``description`` is its meaning (the reference table, the JSON schema). Any
``Config`` that exists is valid: building one raises a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    ValidationError,
    field_validator,
    model_validator,
)

from meshkit.choices import (
    ATTENTION_KINDS,
    BATCH_ROLES,
    CONTEXT_METHODS,
    DATA_KINDS,
    DISPATCH_MODES,
    DTYPES,
    EXCHANGE_METHODS,
    EXCHANGE_ORDERS,
    LOGICAL_AXES,
    MLP_KINDS,
    MOE_TENSOR_MODES,
    PIPELINE_SCHEDULES,
    REMAT_POLICIES,
    ROLES,
    TOKEN_DTYPES,
)
from meshkit.config.imports import FACTORY_PARAMETERS, LOSS_PARAMETERS, import_callable
from meshkit.config.rules import TEXT_VOCAB, role_claims, validate
from meshkit.config.values import (
    Axes,
    AxisField,
    Bool,
    ConfigError,
    Float,
    ImportPath,
    Int,
    Kwargs,
    LogicalAxes,
    Path,
    Ranks,
    Seed,
    StageLayers,
    StepRange,
    Str,
    show,
    thaw,
    unknown,
)
from meshkit.data.sources import RAW_DTYPE
from meshkit.exchange.cost import PRESETS, is_topology_file, load_topology
from meshkit.strategy.axes import axis_names
from meshkit.strategy.ranks import Strategy

# pydantic's messages name Python types; a config's author writes YAML.
_YAML_TERMS = (("dictionary", "mapping"), ("tuple", "list"), (" after validation", ""))


def _error(e: ValidationError, prefix: tuple[str, ...] = ()) -> ConfigError:
    """Pydantic's first error (an unknown key first) as a ConfigError naming its key."""
    err = min(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
    at = err["loc"][:-2] if err["loc"][-1:] == ("[key]",) else err["loc"]  # a bad dict key
    loc = [*prefix, *map(str, at)]
    key, cause = ".".join(loc), err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # a check that names its own key
        return cause
    if err["type"] == "extra_forbidden":
        return unknown(key, all_keys() if len(loc) > 1 else [*SECTIONS, *all_keys()])
    if isinstance(cause, ValueError):  # a validator of ours: the message shows the value
        return ConfigError(f"{key}: {cause}")
    msg = err["msg"][:1].lower() + err["msg"][1:]
    for python, yaml in _YAML_TERMS:
        msg = msg.replace(python, yaml)
    return ConfigError(f"{key}: {msg}, got {show(err['input'])}")


class _Model(BaseModel):
    """Frozen, unknown keys rejected; construction raises one ConfigError naming the key."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
    section: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _error(e, (self.section,) if self.section else ()) from None


class _Section(_Model):
    """One section: fields coerced and bounded, choices checked, then :meth:`_check`."""

    @model_validator(mode="after")
    def _checks(self) -> _Section:
        for name, field in type(self).model_fields.items():
            extra: Any = field.json_schema_extra or {}
            choices = extra.get("enum")
            value = getattr(self, name)
            if choices is not None and value is not None and value not in choices:
                named = [c for c in choices if c is not None]  # null is no name to offer
                raise ConfigError(f"{self.section}.{name}: must be one of "
                                  f"{', '.join(named)}; got {show(value)}")
        self._check()
        return self

    def _check(self) -> None:
        """Checks between the fields of one section."""


def _one_of(choices: tuple[str, ...], *, nullable: bool = False) -> Any:
    """``json_schema_extra`` listing a field's values: choices.py's tuple itself.

    A nullable field's ``enum`` ends in ``None``: the schema's ``enum`` binds the whole
    value, so without it an editor would reject the ``null`` default.
    """
    return {"enum": (*choices, None) if nullable else choices}


class MeshConfig(_Section):
    """The parallel strategy: named mesh axes and optionally an explicit rank array.

    Examples:
        >>> MeshConfig(axes={"node": -1, "device": 2}, ranks=[[3, 2], [1, 0]]).strategy().shape
        {'node': 2, 'device': 2}
    """

    section: ClassVar[str] = "mesh"
    axes: Axes = Field(default={"node": 2, "device": 4}, description="mesh axes, outer → inner "
        "(slowest links first): name → size; their product is the number of devices")
    ranks: Ranks = Field(default=None, description="optional nested list of rank ids, shaped like "
        "`axes` (a permutation of 0..size-1; one axis size may then be -1); null = row-major")

    def _check(self) -> None:
        try:
            self.strategy()
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None

    def strategy(self) -> Strategy:
        """The :class:`~meshkit.strategy.ranks.Strategy` of ``axes`` and ``ranks``."""
        return Strategy.from_config({"axes": dict(self.axes), "ranks": thaw(self.ranks)})


class ParallelConfig(_Section):
    """Each mesh axis's role; the expert role is the exchange's node and device axes."""

    section: ClassVar[str] = "parallel"
    data: AxisField = Field(default=(), description="mesh axes that split the batch, parameters "
        "replicated, gradients all-reduced over them; every axis with no role is a data axis too "
        "(`meshkit mesh` and the start-up line say `no role given`)")
    fsdp: AxisField = Field(default=(), description="mesh axes that split the batch and shard "
        "parameters and AdamW moments on the model width (ZeRO-3); weights are all-gathered for "
        "compute; an expert axis may be named here too: it then shards every non-expert weight "
        "as well as the experts")
    zero1: Bool = Field(default=False, description="ZeRO-1: shard the optimizer state (AdamW "
        "moments) over the data axes, each on its largest dimension they divide, while the "
        "parameters stay replicated; each device updates its shard and the parameters are "
        "all-gathered (needs a data axis)")
    tensor: AxisField = Field(default=(), description="mesh axes for Megatron tensor parallelism: "
        "attention heads, the vocabulary (embedding, head) and a dense MLP's hidden width split, "
        "one all-reduce after attention and one after the MLP; in an MoE layer, what "
        "parallel.moe_tensor says")
    sequence_parallel: Bool = Field(default=False, description="Megatron sequence "
        "parallelism: between blocks each tensor rank holds T/t of every sequence's positions, "
        "so norms and residuals run on 1/t of the tokens; the all-reduce after a row-parallel "
        "block becomes a reduce-scatter and an all-gather feeds the next column-parallel one "
        "(needs tensor axes dividing train.seq_len)")
    moe_tensor: Str = Field(default="auto", description="what the tensor axes split in an MoE "
        "layer: `tokens` (each tensor rank routes and runs its own slice of the tokens, whole "
        "experts), `ffn` (each expert's d_ff split over the tensor ranks, one all-reduce after "
        "the combine: expert tensor parallelism) or `auto` (the cost model weighs memory and "
        "time, and the start-up line says which)", json_schema_extra=_one_of(MOE_TENSOR_MODES))
    context: AxisField = Field(default=(), description="mesh axes that split each sequence "
        "(context parallelism), outer first as in mesh.axes; no other role may name them, and "
        "the batch is not split over them. With c context devices the sequence is cut into 2c "
        "chunks and device i holds chunks i and 2c-1-i (even causal work), so train.seq_len "
        "must be divisible by 2c; attention exchanges K/V over them (parallel.context_method)")
    context_method: Str = Field(default="auto", description="how attention crosses the "
        "context axes: `all_gather` (K and V gathered), `ring` (K/V blocks passed round the "
        "group, online softmax), `ulysses` (all-to-all from sequence to head shards; the query "
        "and kv heads of a tensor rank must divide among the context devices), `hierarchical` "
        "(Ulysses over the last context axis, a ring over the others; needs two or more) or "
        "`auto` (the cost model picks among those the heads allow); anything but `auto` needs "
        "parallel.context", json_schema_extra=_one_of(CONTEXT_METHODS))
    pipeline: Str | None = Field(default=None, description="one mesh axis (or null) splitting the "
        "layers into consecutive stages (GPipe)")
    microbatches: Int = Field(default=1, ge=1, description="pipeline microbatches per step; "
        "divides the per-device batch")
    schedule: Str = Field(default="gpipe", description="pipeline schedule: `gpipe` (every "
        "microbatch's forward pass, then the backward passes; activations of all M kept), "
        "`1f1b` (one forward and one backward microbatch per stage each tick; a stage keeps "
        "2S-1 microbatches' inputs whatever M) or `interleaved` (circular: each stage holds "
        "parallel.virtual_stages non-adjacent chunks of layers); needs parallel.pipeline",
        json_schema_extra=_one_of(PIPELINE_SCHEDULES))
    virtual_stages: Int = Field(default=1, ge=1, description="with `parallel.schedule: "
        "interleaved`, the chunks of layers each pipeline stage holds (virtual stage c·S+s is "
        "chunk c of stage s; the stacked layers are stored in that order): divides "
        "model.num_layers/S; the bubble is (S-1)/(v·M+S-1), and M must be >= S")
    stage_layers: StageLayers = Field(default=None, description="layers of each pipeline "
        "stage, first to last, e.g. `[3, 5]`: one entry per stage, summing to model.num_layers "
        "(every stage then holds max(stage_layers) layer slots, the unused ones idle); null = "
        "num_layers split evenly")
    logical_axes: LogicalAxes = Field(default={}, description="a model's own logical axis "
        "names (its parameters' `out_sharding` metadata) → a role (`tensor`, `fsdp`, ...), a "
        f"logical name (built in: {', '.join(f'`{n}`' for n in LOGICAL_AXES)}; or one given "
        "before it here), mesh axes, or null (replicated); e.g. `{mlp: tensor, kv_heads: "
        "tensor, seq: null}`")


class ExchangeConfig(_Section):
    """How the MoE layer's all-to-all runs and which mesh axes it spans."""

    section: ClassVar[str] = "exchange"
    method: Str = Field(default="auto", description="all_to_all method: `auto` (the cost model "
        "picks per call), `flat` or `hierarchical` (two-stage)",
        json_schema_extra=_one_of(EXCHANGE_METHODS))
    node_axis: AxisField = Field(default="node", description="mesh axis, or list of axes, "
        "spanning nodes: the outer exchange stage")
    device_axis: AxisField = Field(default="device", description="mesh axis, or list of axes, "
        "spanning a node's devices: the inner stage; experts are sharded over node_axis + "
        "device_axis")
    order: Str = Field(default="node_first", description="stage order of the two-stage exchange: "
        "`node_first` or `device_first`",
        json_schema_extra=_one_of(EXCHANGE_ORDERS))
    dedup: Bool = Field(default=False, description="node-deduplicated exchange: a token crosses "
        "to each node once and its outputs there are summed before crossing back (needs node and "
        "device axes, dispatch: sort)")
    topology: Str | None = Field(default=None, description="cost-model preset for `method: "
        f"auto` ({', '.join(f'`{p}`' for p in PRESETS)}) or a topology file (`*.yaml`, as "
        "`meshkit calibrate` writes); null = meshkit.exchange.cost.default_topology")

    @field_validator("topology")
    @classmethod
    def _topology(cls, value: str | None) -> str | None:
        if value is None or not is_topology_file(value):
            if value is not None and value not in PRESETS:
                raise ValueError(f"must be one of {', '.join(PRESETS)} or a topology file "
                              f"(*.yaml); got {show(value)}")
            return value
        path = os.path.expanduser(value)
        try:
            load_topology(path, nodes=1)
        except ValueError as e:
            raise ValueError(str(e)) from None
        return path

    def _check(self) -> None:
        both = [*axis_names(self.node_axis, "exchange.node_axis"),
                *axis_names(self.device_axis, "exchange.device_axis")]
        twice = sorted({a for a in both if both.count(a) > 1})
        if twice:
            raise ConfigError(f"exchange.device_axis: axes {twice} are also in "
                              "exchange.node_axis; the node and device axes must be disjoint")


class ModelConfig(_Section):
    """The model: meshkit's decoder-only MoE transformer, or a user's own (``factory``).

    With ``factory`` set, the transformer's keys are not used, except ``vocab_size``: the
    token ids the data holds.

    Examples:
        >>> ModelConfig(d_model=32, num_heads=4).head_dim
        8
        >>> ModelConfig(num_heads=3)
        Traceback (most recent call last):
        ...
        meshkit.config.values.ConfigError: model.d_model: 64 is not divisible by model.num_heads=3
    """

    section: ClassVar[str] = "model"
    vocab_size: Int = Field(default=16, ge=2, description="number of token ids (>= "
                            f"{TEXT_VOCAB} for `data.kind: text`)")
    d_model: Int = Field(default=64, ge=1, description="model width; divisible by num_heads, with "
        "an even head size (rotary)")
    num_layers: Int = Field(default=2, ge=1, description="transformer blocks, each with an MoE "
        "feed-forward (a dense MLP in the first model.dense_layers, or in all of them when "
        "model.num_experts is 0)")
    num_heads: Int = Field(default=4, ge=1, description="attention heads")
    num_kv_heads: Int | None = Field(default=None, ge=1, description="key/value heads "
        "(grouped-query attention): divides num_heads, each serving num_heads/num_kv_heads "
        "query heads; the tensor axes split them where they divide them and replicate them "
        "otherwise; null = num_heads (multi-head attention)")
    d_ff: Int = Field(default=128, ge=1, description="hidden size of each expert's gated FFN "
        "and of a dense layer's MLP")
    num_experts: Int = Field(default=8, ge=0, description="experts per MoE layer; divisible by "
        "the number of expert devices (product of the sizes of exchange.node_axis and "
        "exchange.device_axis); 0 = a dense model, every layer a dense MLP (model.mlp)")
    dense_layers: Int = Field(default=0, ge=0, description="the first this many layers of an "
        "MoE model are dense MLPs (model.mlp), as DeepSeek-V3's first 3; fewer than "
        "model.num_layers")
    mlp: Str = Field(default="swiglu", description="a dense layer's MLP: `swiglu` (gate, up, "
        "down) or `gelu` (up, down), d_ff wide; the experts are SwiGLU",
        json_schema_extra=_one_of(MLP_KINDS))
    top_k: Int = Field(default=2, ge=1, description="experts per token, 1 to num_experts; gates "
        "renormalised to sum to 1 when >= 2")
    capacity_factor: Float = Field(default=1.25, ge=0, description="expert capacity = "
        "ceil(capacity_factor × tokens × top_k / num_experts); tokens beyond it are dropped; 0 = "
        "dropless (worst-case buffers: tokens slots per expert)")
    num_shared_experts: Int = Field(default=0, ge=0, description="shared experts (DeepSeekMoE): "
        "one dense SwiGLU of width num_shared_experts × d_ff on every token, added to the routed "
        "output")
    max_nodes: Int | None = Field(default=None, ge=1, description="node-limited routing "
        "(DeepSeek-V3): a token's experts lie on at most this many nodes (product of "
        "exchange.node_axis); null = no limit")
    aux_loss_weight: Float = Field(default=0.01, ge=0, description="weight of the Switch "
        "load-balancing loss")
    z_loss_weight: Float = Field(default=0.001, ge=0, description="weight of the router z-loss")
    dispatch: Str = Field(default="sort", description="`sort` (scatter by sorted token indices) "
        "or `einsum` (the GShard one-hot baseline, for benchmarks)",
        json_schema_extra=_one_of(DISPATCH_MODES))
    dtype: Str = Field(default="float32", description="compute dtype: `float32` or `bfloat16`",
        json_schema_extra=_one_of(DTYPES))
    remat: Str = Field(default="none", description="activation checkpointing of each block: "
        "`none` keeps every activation for the backward pass, `full` keeps only each block's "
        "input and recomputes the block, `save_dots` keeps the matmul outputs and recomputes "
        "the rest", json_schema_extra=_one_of(REMAT_POLICIES))
    attention: Str = Field(default="xla", description="attention: `xla` materialises the "
        "[B, H, T, T] scores, `dot_product` is jax.nn.dot_product_attention (cuDNN on GPU "
        "where available), `chunked` is blockwise with an online softmax (memory linear in "
        "T on every backend)", json_schema_extra=_one_of(ATTENTION_KINDS))
    attention_chunk: Int = Field(default=128, ge=1, description="query and key/value block "
        "length of `attention: chunked`; must divide train.seq_len (a chunk longer than the "
        "sequence is one block)")
    factory: ImportPath | None = Field(default=None, description="your own model instead: the "
        "import path `module:function` of `factory(rngs, **factory_kwargs) -> nnx.Module`, "
        "called as `factory(rngs=..., **factory_kwargs)` (so it must name a parameter "
        "`rngs`; imported only by `meshkit train` and `meshkit plan`), "
        "its parameters named by logical axes (`parallel.logical_axes`); null = the MoE "
        "transformer above")
    factory_kwargs: Kwargs = Field(default={}, description="keyword arguments of "
        "`model.factory`, e.g. `{d_model: 64}`")
    loss: ImportPath | None = Field(default=None, description="import path `module:function` "
        "of `loss(model, batch) -> loss` or `(loss, metrics)`, called as "
        "`loss(model=..., batch=...)`, batch `[B, T+1]` int32 tokens; "
        "null = the transformer's own loss, or next-token cross-entropy of a factory's "
        "`model(batch[:, :-1])` logits")
    flops_per_token: Float | None = Field(default=None, gt=0, description="training FLOPs "
        "(forward and backward) of one token, for TFLOP/s and MFU; null = counted by "
        "meshkit.plan.flops for the transformer, from XLA's cost analysis of the compiled "
        "train step for a factory's model")

    def _check(self) -> None:
        self._check_imports()
        if self.num_experts == 0 and self.dense_layers:
            raise ConfigError(f"model.dense_layers: {self.dense_layers} dense layers need an MoE "
                              "model; with model.num_experts: 0 every layer is dense already")
        if self.num_experts and self.dense_layers >= self.num_layers:
            raise ConfigError(
                f"model.dense_layers: {self.dense_layers} is not fewer than model.num_layers="
                f"{self.num_layers}; for a dense model set model.num_experts: 0")
        if self.num_experts and self.top_k > self.num_experts:
            raise ConfigError(
                f"model.top_k: {self.top_k} is more than model.num_experts={self.num_experts}")
        if self.d_model % self.num_heads:
            raise ConfigError(f"model.d_model: {self.d_model} is not divisible by "
                              f"model.num_heads={self.num_heads}")
        if self.num_heads % self.kv_heads:
            raise ConfigError(f"model.num_kv_heads: {self.kv_heads} does not divide "
                              f"model.num_heads={self.num_heads} (each K/V head serves an equal "
                              "group of query heads)")
        if self.head_dim % 2:
            raise ConfigError(f"model.d_model: head size d_model / num_heads = {self.head_dim} "
                              "must be even (rotary positions rotate pairs of features)")

    @property
    def head_dim(self) -> int:
        """Features per attention head, ``d_model // num_heads``."""
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` where it is null.

        Examples:
            >>> ModelConfig(num_heads=8, d_model=64).kv_heads, ModelConfig(
            ...     num_heads=8, num_kv_heads=2, d_model=64).kv_heads
            (8, 2)
        """
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def _check_imports(self) -> None:
        """What can be checked without importing: building a config never runs its code."""
        if self.factory is None and self.factory_kwargs:
            raise ConfigError("model.factory_kwargs: keyword arguments for model.factory, "
                              "which is null")

    def factory_function(self) -> Any:
        """Import ``model.factory``: ``rngs -> model``, ``factory_kwargs`` bound; or ``None``.

        The import is announced on the ``meshkit`` logger first
        (:func:`meshkit.config.imports.import_object`); the factory must have a parameter
        named ``rngs`` (:func:`meshkit.config.imports.import_callable`).

        Returns:
            A function of the ``nnx.Rngs``, which calls
            ``factory(rngs=rngs, **factory_kwargs)``; ``None`` without a factory.

        Raises:
            ConfigError: the module does not import, or the factory cannot be called
                so; one line naming ``model.factory`` or ``model.factory_kwargs``.

        Examples:
            >>> ModelConfig(factory="timeit:timeit").factory_function()
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            meshkit.config.values.ConfigError: model.factory: timeit:timeit has no parameter \
named 'rngs': meshkit calls it as timeit(rngs=...), and only a function written for meshkit \
takes that
        """
        if self.factory is None:
            return None
        fn = import_callable(self.factory, key="model.factory", parameters=FACTORY_PARAMETERS,
                             kwargs=self.factory_kwargs, kwargs_key="model.factory_kwargs")
        kwargs = thaw(self.factory_kwargs)
        return lambda rngs: fn(rngs=rngs, **kwargs)

    def loss_function(self) -> Any:
        """Import ``model.loss``: ``(model, batch) -> loss or (loss, metrics)``; or ``None``.

        Returns:
            A function of ``(model, batch)`` that calls ``loss(model=model,
            batch=batch)``; ``None`` without one.

        Raises:
            ConfigError: the module does not import, or the loss has no parameters named
                ``model`` and ``batch``; one line naming ``model.loss``.

        Examples:
            >>> ModelConfig(loss="operator:sub").loss_function()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            meshkit.config.values.ConfigError: model.loss: operator:sub has no parameter ...
        """
        if self.loss is None:
            return None
        fn = import_callable(self.loss, key="model.loss", parameters=LOSS_PARAMETERS)
        return lambda model, batch: fn(model=model, batch=batch)


class DataConfig(_Section):
    """The training data source."""

    section: ClassVar[str] = "data"
    kind: Str = Field(default="markov", description="`markov` (synthetic, with an exact entropy "
        "rate), `text` (bytes of data.path) or `tokens` (integer ids in data.path: a `.npy` "
        "array, or a raw file of data.dtype)",
        json_schema_extra=_one_of(DATA_KINDS))
    path: Path | None = Field(default=None, description="data file; required for `text` and "
        "`tokens`")
    dtype: Str | None = Field(default=None, description="integer type of the ids in a "
        f"`tokens` file ({', '.join(f'`{t}`' for t in TOKEN_DTYPES)}); null = a `.npy` file's "
        f"own, `{RAW_DTYPE}` for a raw file (little-endian, no header); a `.npy` file's header "
        "must agree", json_schema_extra=_one_of(TOKEN_DTYPES, nullable=True))
    order: Int = Field(default=2, ge=1, description="Markov context length (tokens the next one "
        "depends on)")
    concentration: Float = Field(default=0.1, gt=0, description="Dirichlet concentration of the "
        "Markov transitions (smaller = lower entropy)")
    seed: Seed = Field(default=0, description="seed of the Markov transition "
        "table")
    eos_id: Int | None = Field(default=None, ge=0, description="the id that ends each "
        "document packed into a row (in [0, model.vocab_size)): attention never crosses a "
        "document and positions restart at each one, under every context method; null = a "
        "row is one sequence")

    def _check(self) -> None:
        if self.kind != "markov" and self.path is None:
            raise ConfigError(f"data.path: required for data.kind={self.kind!r}")


class TrainConfig(_Section):
    """The optimisation loop, evaluation, logging and checkpoints."""

    section: ClassVar[str] = "train"
    steps: Int = Field(default=300, ge=1, description="optimizer steps")
    batch_size: Int = Field(default=32, ge=1, description="global batch in sequences; divisible "
        "by the batch devices (the batch is split over the data, fsdp and expert axes) times "
        "parallel.microbatches")
    seq_len: Int = Field(default=64, ge=1, description="tokens per sequence")
    lr: Float = Field(default=1e-2, gt=0, description="peak learning rate of AdamW")
    warmup_steps: Int = Field(default=30, ge=0, description="linear warmup steps before the "
        "cosine decay (longer than steps: all warmup)")
    weight_decay: Float = Field(default=0.01, ge=0, description="AdamW weight decay")
    grad_clip: Float = Field(default=1.0, gt=0, description="clip gradients to this global norm")
    seed: Seed = Field(default=0, description="seed of the parameters and the "
        "data order (a batch depends on seed and step only, so a resumed run matches an "
        "uninterrupted one)")
    log_every: Int = Field(default=10, ge=1, description="steps between lines of "
        "`<workdir>/metrics.jsonl`")
    eval_every: Int = Field(default=100, ge=1, description="steps between evaluations")
    eval_batches: Int = Field(default=4, ge=1, description="batches per evaluation")
    checkpoint_every: Int = Field(default=100, ge=1, description="steps between checkpoints (one "
        "is also written at the end)")
    keep_checkpoints: Int = Field(default=2, ge=1, description="newest checkpoints kept")
    workdir: Path = Field(default="runs/default", description="directory for `config.yaml`, "
        "metrics and checkpoints; a rerun resumes from it")
    profile_steps: StepRange = Field(default=None, description="`[start, stop]`: write a "
        "`jax.profiler` trace of steps start..stop-1 to `<workdir>/profile` (null: no trace)")

    def _check(self) -> None:
        if self.profile_steps is not None and self.profile_steps[1] > self.steps + 1:
            raise ConfigError(
                f"train.profile_steps: stop {self.profile_steps[1]} is past the run's last "
                f"step (train.steps={self.steps}; the steps start..stop-1 are traced, so "
                f"stop may be at most {self.steps + 1})")


SECTIONS: dict[str, type[_Section]] = {
    c.section: c for c in (MeshConfig, ParallelConfig, ExchangeConfig, ModelConfig,
                           DataConfig, TrainConfig)
}


def all_keys() -> list[str]:
    """Every dotted key, section by section, in file order.

    Examples:
        >>> all_keys()[:3]
        ['mesh.axes', 'mesh.ranks', 'parallel.data']
    """
    return [f"{name}.{key}" for name, cls in SECTIONS.items() for key in cls.model_fields]


class Config(_Model):
    """A whole run, validated on construction (each section, then ``validate``).

    Raises:
        ConfigError: a section of the wrong type, or any failed check.

    Examples:
        >>> Config().num_expert_devices, Config().strategy().size
        (8, 8)
    """

    mesh: InstanceOf[MeshConfig] = Field(default_factory=MeshConfig)
    parallel: InstanceOf[ParallelConfig] = Field(default_factory=ParallelConfig)
    exchange: InstanceOf[ExchangeConfig] = Field(default_factory=ExchangeConfig)
    model: InstanceOf[ModelConfig] = Field(default_factory=ModelConfig)
    data: InstanceOf[DataConfig] = Field(default_factory=DataConfig)
    train: InstanceOf[TrainConfig] = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _validate(self) -> Config:
        validate(self)
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build and validate a config from nested mappings (e.g. parsed YAML).

        Args:
            d: ``{section: {key: value}}``; missing keys take their defaults, a section
                may be ``None`` (all defaults) or a section object.

        Returns:
            The validated config.

        Raises:
            ConfigError: an unknown key (naming the closest valid one), a bad value, or
                any failed check; the message names the dotted key.

        Examples:
            >>> Config.from_dict({"train": {"steps": 5, "warmup_steps": 0}}).train.steps
            5
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"config: expected a mapping of sections {list(SECTIONS)}, "
                              f"got {show(d)}")
        for name in d:
            if name not in SECTIONS:
                raise unknown(str(name), [*SECTIONS, *all_keys()])
        sections: dict[str, Any] = {}
        for name, section_cls in SECTIONS.items():
            value = {} if d.get(name) is None else d[name]
            if isinstance(value, Mapping):  # a YAML key such as 1 is an unknown key '1'
                value = section_cls(**{str(k): v for k, v in value.items()})
            elif not isinstance(value, section_cls):
                raise ConfigError(f"{name}: expected a mapping of keys, got {show(value)}")
            sections[name] = value
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dicts and lists, YAML/JSON-safe; :meth:`from_dict` inverts it.

        Examples:
            >>> Config().to_dict()["mesh"]["axes"]
            {'node': 2, 'device': 4}
        """
        return {name: {k: thaw(v) for k, v in getattr(self, name)} for name in SECTIONS}

    def to_yaml(self) -> str:
        """The config as YAML (training saves it as ``<workdir>/config.yaml``).

        Examples:
            >>> Config().to_yaml().startswith("mesh:")
            True
        """
        import yaml  # here: the sections need no YAML

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def replace(self, **sections: Any) -> Config:
        """A copy with some sections replaced or partly overridden, validated again.

        Args:
            **sections: per section name, a section object or a mapping of new values.

        Returns:
            The new config.

        Raises:
            ConfigError: an unknown section or key, or any failed check.

        Examples:
            >>> Config().replace(model={"num_experts": 16}, train={"steps": 40}).model.top_k
            2
        """
        new: dict[str, Any] = dict(self)
        for name, value in sections.items():
            if name in SECTIONS and isinstance(value, Mapping):
                value = {**dict(new[name]), **value}
            new[name] = value
        return Config.from_dict(new)

    def strategy(self) -> Strategy:
        """The mesh section's :class:`~meshkit.strategy.ranks.Strategy` (numpy only)."""
        return self.mesh.strategy()

    @property
    def node_axes(self) -> tuple[str, ...]:
        """``exchange.node_axis`` as a tuple of mesh axis names."""
        return axis_names(self.exchange.node_axis, "exchange.node_axis")

    @property
    def device_axes(self) -> tuple[str, ...]:
        """``exchange.device_axis`` as a tuple of mesh axis names."""
        return axis_names(self.exchange.device_axis, "exchange.device_axis")

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The axes experts are sharded over: node axes, then device axes."""
        return (*self.node_axes, *self.device_axes)

    @property
    def num_expert_devices(self) -> int:
        """Devices one MoE layer's experts are spread over (product of the expert axes)."""
        return math.prod(self.strategy().shape[a] for a in self.expert_axes)

    @property
    def num_devices(self) -> int:
        """Devices the mesh needs (the strategy's size)."""
        return self.strategy().size

    @property
    def roles(self) -> dict[str, str]:
        """Each mesh axis's role (one of :data:`meshkit.choices.ROLES`), in mesh order.

        Examples:
            >>> Config().replace(mesh={"axes": {"pp": 2, "tp": 2, "node": 2}},
            ...     parallel={"tensor": "tp", "pipeline": "pp"}, exchange={"device_axis": []}).roles
            {'pp': 'pipeline', 'tp': 'tensor', 'node': 'expert'}
        """
        claims = role_claims(self.parallel, self.exchange)
        # An expert axis also named in parallel.fsdp is listed as expert (its claims come
        # in ROLES order, the exchange's last); axes_with_role("fsdp") has it too.
        return {a: claims[a][-1][0] if a in claims else "data" for a in self.strategy().shape}

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes that shard the parameters (ZeRO-3), expert axes named in
        ``parallel.fsdp`` too, in mesh order.

        Examples:
            >>> Config().replace(mesh={"axes": {"ep": 8}}, parallel={"fsdp": "ep"},
            ...     exchange={"node_axis": [], "device_axis": "ep"}).fsdp_axes
            ('ep',)
        """
        return self.axes_with_role("fsdp")

    def axes_with_role(self, *roles: str) -> tuple[str, ...]:
        """The mesh axes that have any of ``roles``, in mesh order.

        Args:
            *roles: names from :data:`meshkit.choices.ROLES`.

        Returns:
            The axes, outer → inner.

        Raises:
            ValueError: an unknown role.

        Examples:
            >>> Config().axes_with_role("expert")
            ('node', 'device')
        """
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown roles {bad}; valid: {', '.join(ROLES)}")
        claims = role_claims(self.parallel, self.exchange)
        return tuple(a for a in self.strategy().shape
                     if any(r in roles for r, _ in claims.get(a, [("data", "")])))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: data, fsdp and expert axes, in mesh order
        (not the context axes: they split each sequence, not the batch's rows)."""
        return self.axes_with_role(*BATCH_ROLES)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """``parallel.context`` as a tuple of mesh axis names, outer first.

        Examples:
            >>> Config().replace(mesh={"axes": {"dp": 2, "cp": 4}}, parallel={
            ...     "context": "cp"}, exchange={"node_axis": [], "device_axis": []}).context_axes
            ('cp',)
        """
        return axis_names(self.parallel.context, "parallel.context")

    @property
    def context_devices(self) -> int:
        """How many ways each sequence is split: the product of the context axes' sizes
        (1 without context axes)."""
        return math.prod(self.strategy().shape[a] for a in self.context_axes)

    @property
    def unnamed_axes(self) -> tuple[str, ...]:
        """The mesh axes no config key names, in mesh order: each becomes a data axis.

        Examples:
            >>> Config().replace(mesh={"axes": {"cp": 4, "node": 2}},
            ...                  exchange={"device_axis": []}).unnamed_axes
            ('cp',)
        """
        claims = role_claims(self.parallel, self.exchange)
        return tuple(a for a in self.strategy().shape if a not in claims)

    def describe_roles(self) -> str:
        """Each mesh axis with its size and role, in mesh order, on one line; an axis that
        no key names is a data axis, and says so.

        Returns:
            e.g. ``"cp=4 (no role given: data), node=2 expert"``.

        Examples:
            >>> Config().replace(mesh={"axes": {"cp": 4, "node": 2}},
            ...                  exchange={"device_axis": []}).describe_roles()
            'cp=4 (no role given: data), node=2 expert'
        """
        shape, unnamed = self.strategy().shape, self.unnamed_axes
        return ", ".join(f"{a}={shape[a]} (no role given: data)" if a in unnamed
                         else f"{a}={shape[a]} {self.role_label(a)}" for a in shape)

    def role_label(self, axis: str) -> str:
        """One mesh axis's role as ``meshkit mesh`` shows it: ``expert+fsdp`` for an
        expert axis named in ``parallel.fsdp`` too, ``data (no role given)`` for an axis
        no key names.

        Examples:
            >>> Config().replace(mesh={"axes": {"cp": 4, "node": 2}},
            ...     exchange={"device_axis": []}).role_label("cp")
            'data (no role given)'
        """
        if axis in self.unnamed_axes:
            return "data (no role given)"
        role = self.roles[axis]
        # An expert axis named in parallel.fsdp too does both jobs: say so.
        return role + ("+fsdp" if role == "expert" and axis in self.fsdp_axes else "")

    @property
    def batch_devices(self) -> int:
        """How many ways the batch is split: the product of the :attr:`batch_axes` sizes."""
        return math.prod(self.strategy().shape[a] for a in self.batch_axes)
