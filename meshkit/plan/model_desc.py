"""A model description the planner reads: any decoder-only transformer, dense or MoE.

meshkit's own config (:class:`meshkit.config.ModelConfig`) describes the model meshkit
builds. The planner needs less and more: it never builds the model, but it must count
the parameters, FLOPs and memory of a published one (grouped-query attention, a GELU
MLP, biases, a dense first layer, fine-grained experts) and the choices of a training
run (remat, attention kind, gradient accumulation, dtypes). :class:`ModelDesc` holds
that, read from a flat YAML file (``configs/models/llama2_7b.yaml`` and the others) by
:func:`load_model_desc`.

JAX-free: the planner ranks thousands of layouts with numpy only.

Examples:
    >>> desc = ModelDesc(name="tiny", vocab_size=16, d_model=64, num_layers=2,
    ...                  num_heads=4, num_kv_heads=2, d_ff=128, seq_len=64, batch_size=32)
    >>> desc.is_moe, desc.params
    (False, 76096)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from meshkit.choices import (
    ATTENTION_KINDS,
    DTYPES,
    MLP_KINDS,
    MOE_TENSOR_MODES,
    PIPELINE_SCHEDULES,
    REMAT_POLICIES,
)
from meshkit.errors import UsageError

__all__ = ["DTYPE_BYTES", "Measured", "ModelDesc", "ModelDescError",
           "default_attention_chunk", "load_model_desc"]

#: Bytes of one element of each dtype a description may name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}


class ModelDescError(UsageError):
    """A bad model description: one line naming the field (exit 2 from the CLI).

    Examples:
        >>> issubclass(ModelDescError, ValueError)
        True
    """


@dataclasses.dataclass(frozen=True)
class Measured:
    """A user's model (``model.factory``) as measured, where no formula knows its shape:
    what :class:`ModelDesc` counts for a transformer it describes.

    Attributes:
        params: parameter elements (``jax.eval_shape`` of the factory's model).
        fsdp_params: of them, those whose logical names the fsdp role shards.
        flops_per_token: training FLOPs of one token: XLA's cost analysis of the step
            compiled on one device, the difference between two batch sizes (so the
            optimizer's per-parameter work is left out).
        bytes_per_token: XLA's bytes (argument + temp + output − alias) a token adds to
            the one-device step: the same two compiles' difference over their tokens.
        bytes_per_param: XLA's bytes of that step at no tokens (the line through the two
            compiles) per parameter: state, gradients and the update's temporaries.
        source: how it was measured, for the report.

    Examples:
        >>> Measured(params=10, fsdp_params=8, flops_per_token=60.0, bytes_per_token=4.0,
        ...          bytes_per_param=16.0).params
        10
    """

    params: int
    fsdp_params: int
    flops_per_token: float
    bytes_per_token: float
    bytes_per_param: float
    source: str = ""


@dataclasses.dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer and its training batch, as the planner sees them.

    Attributes:
        name: a label.
        source: where the numbers come from (a paper, a model card).
        vocab_size, d_model, num_layers: vocabulary, width, blocks.
        num_heads: query heads; ``num_kv_heads`` key/value heads (grouped-query
            attention when fewer; must divide ``num_heads``; ``None`` = ``num_heads``).
        head_dim: features per head (``None``: ``d_model // num_heads``).
        d_ff: hidden width of a dense MLP (the dense layers' of an MoE model).
        mlp: one of :data:`meshkit.choices.MLP_KINDS`: the dense layers' MLP, and the
            experts' unless ``expert_mlp`` says otherwise.
        expert_mlp: the experts' MLP (one of :data:`meshkit.choices.MLP_KINDS`), or
            ``None``: ``mlp`` (meshkit's experts are SwiGLU whatever ``model.mlp`` says).
        bias: linear layers with biases.
        tie_embeddings: the output head shares the embedding matrix.
        num_experts: routed experts per MoE layer (1: a dense model, every layer a dense
            MLP; meshkit's ``model.num_experts: 0``).
        top_k: experts per token.
        num_shared_experts: experts every token runs (DeepSeekMoE).
        expert_d_ff: each expert's hidden width (``None``: ``d_ff``; smaller for
            fine-grained experts).
        dense_layers: leading blocks with a dense MLP instead of experts.
        capacity_factor: expert capacity factor; 0 = dropless (worst-case buffers).
        max_nodes: node-limited routing (``model.max_nodes``): each token's experts lie
            on at most this many nodes, so the deduplicated exchange sends a token to
            at most ``max_nodes`` nodes (DeepSeek-V3: 4); ``None``: no limit.
        seq_len, batch_size: tokens per sequence, sequences per optimizer step.
        remat: one of :data:`meshkit.choices.REMAT_POLICIES`, or ``None``: the planner
            tries each.
        attention: one of :data:`meshkit.choices.ATTENTION_KINDS`, or ``None``: ``xla``.
        attention_chunk: keys per block of ``chunked`` attention (``None``: the config's
            ``model.attention_chunk`` default, 128).
        schedule: one of :data:`meshkit.choices.PIPELINE_SCHEDULES`, or ``None``: the
            planner tries each for a pipelined layout.
        zero1: shard the AdamW moments over the data ways (ZeRO-1, ``parallel.zero1``).
        grad_accum: micro-steps per optimizer step, or ``None``: the planner picks.
        micro_batch_size: sequences per pipeline microbatch on a device (Megatron's
            ``--micro-batch-size``): a pipelined candidate runs as many microbatches as
            that makes of its sequences; ``None``: the planner tries each of
            :data:`meshkit.plan.planner.MICROBATCHES`.
        param_dtype, compute_dtype, optimizer_dtype: from :data:`meshkit.choices.DTYPES`.
        megatron_tp: tensor ways split the dense MLP and the logits (Megatron's
            column/row-parallel MLP and vocab-parallel loss), as meshkit builds them
            (:mod:`meshkit.model.mlp`, a vocab-parallel cross-entropy whose local logits
            are ``[n, V/t]``); ``False``: both replicated over the tensor ways.
        moe_tensor: what the tensor ways split in an MoE layer (``parallel.moe_tensor``):
            ``tokens`` or ``ffn``, or ``None``: the planner tries both.
        measured: a user's model measured (:class:`Measured`), whose parameters, FLOPs
            and memory replace the formulas' (its shape fields are placeholders); not a
            field of a description file.
    """

    name: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    seq_len: int
    batch_size: int
    source: str = ""
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp: str = "swiglu"
    expert_mlp: str | None = None
    bias: bool = False
    tie_embeddings: bool = False
    num_experts: int = 1
    top_k: int = 1
    num_shared_experts: int = 0
    expert_d_ff: int | None = None
    dense_layers: int = 0
    capacity_factor: float = 1.25
    max_nodes: int | None = None
    remat: str | None = None
    attention: str | None = None
    attention_chunk: int | None = None
    schedule: str | None = None
    zero1: bool = False
    grad_accum: int | None = None
    micro_batch_size: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    optimizer_dtype: str = "float32"
    megatron_tp: bool = True
    moe_tensor: str | None = None
    measured: Measured | None = None

    def __post_init__(self) -> None:
        _check(self)

    # ---------------------------------------------------------------- shape

    @functools.cached_property
    def kv_heads(self) -> int:
        """Key/value heads (``num_heads`` without grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @functools.cached_property
    def head_size(self) -> int:
        """Features per head."""
        return self.head_dim or self.d_model // self.num_heads

    @functools.cached_property
    def is_moe(self) -> bool:
        """Whether any layer routes tokens to experts."""
        return self.num_experts > 1 and self.moe_layers > 0

    @functools.cached_property
    def moe_layers(self) -> int:
        """Blocks with routed experts."""
        return self.num_layers - self.dense_layers if self.num_experts > 1 else 0

    @functools.cached_property
    def ff_expert(self) -> int:
        """One expert's hidden width."""
        return self.expert_d_ff or self.d_ff

    @functools.cached_property
    def mlp_mats(self) -> int:
        """Weight matrices of one dense MLP: 3 for SwiGLU (gate, up, down), 2 for GELU."""
        return 3 if self.mlp == "swiglu" else 2

    @functools.cached_property
    def expert_mats(self) -> int:
        """Weight matrices of one expert (as :attr:`mlp_mats`, of ``expert_mlp``)."""
        return 3 if (self.expert_mlp or self.mlp) == "swiglu" else 2

    @functools.cached_property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.batch_size * self.seq_len

    # ---------------------------------------------------------------- parameters

    @functools.cached_property
    def attention_params(self) -> int:
        """One block's attention parameters (q, k, v, o; biases)."""
        d, q, kv = self.d_model, self.num_heads * self.head_size, self.kv_heads * self.head_size
        return d * q + 2 * d * kv + q * d + (q + 2 * kv + d if self.bias else 0)

    @functools.cached_property
    def dense_mlp_params(self) -> int:
        """One dense MLP's parameters."""
        return self.mlp_mats * self.d_model * self.d_ff + (
            (self.mlp_mats - 1) * self.d_ff + self.d_model if self.bias else 0)

    @functools.cached_property
    def expert_params(self) -> int:
        """One expert's parameters."""
        return self.expert_mats * self.d_model * self.ff_expert

    @functools.cached_property
    def routed_params(self) -> int:
        """Routed-expert parameters of the whole model (split over expert ways)."""
        return self.moe_layers * self.num_experts * self.expert_params

    @functools.cached_property
    def params(self) -> int:
        """All parameters."""
        if self.measured is not None:
            return self.measured.params
        d = self.d_model
        norms = 2 * d
        dense_blocks = (self.num_layers - self.moe_layers) * (
            self.attention_params + self.dense_mlp_params + norms)
        moe_blocks = self.moe_layers * (
            self.attention_params + norms + d * self.num_experts
            + self.num_shared_experts * self.expert_params)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d
        return embed + dense_blocks + moe_blocks + self.routed_params

    @functools.cached_property
    def active_params(self) -> int:
        """Parameters one token uses (``top_k`` of the routed experts)."""
        unused = self.moe_layers * (self.num_experts - self.top_k) * self.expert_params
        return self.params - unused

    def flops_per_token(self) -> float:
        """Training FLOPs of one token: ``6 ×`` the matmul parameters it uses, plus
        attention scores ``12 · layers · T · heads · head_dim`` (causal halves neither).

        Returns:
            Forward and backward FLOPs per token.

        Examples:
            >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2,
            ...               num_heads=4, d_ff=128, seq_len=64, batch_size=8)
            >>> d.flops_per_token() > 6 * d.params
            True
        """
        if self.measured is not None:
            return self.measured.flops_per_token
        # The lookup and the norms' scales multiply nothing: not matmul parameters.
        norms = 2 * self.d_model * self.num_layers + self.d_model
        matmul = self.active_params - self.vocab_size * self.d_model - norms
        scores = 12 * self.num_layers * self.seq_len * self.num_heads * self.head_size
        return 6.0 * matmul + scores

    # ---------------------------------------------------------------- meshkit

    @classmethod
    def from_config(cls, model: Any, *, seq_len: int, batch_size: int,
                    name: str = "meshkit") -> ModelDesc:
        """The description of meshkit's own transformer of a config's model section.

        Args:
            model: a :class:`meshkit.config.ModelConfig`.
            seq_len, batch_size: the training batch.
            name: a label.

        Returns:
            The description (SwiGLU experts, the dense layers' ``model.mlp``, the
            config's key/value heads, float32 parameters, Megatron tensor parallelism of
            the dense MLP and the logits); ``model.num_experts: 0`` is a dense model (one
            "expert").

        Examples:
            >>> from meshkit.config import ModelConfig
            >>> ModelDesc.from_config(ModelConfig(), seq_len=64, batch_size=32).num_experts
            8
            >>> dense = ModelConfig(num_experts=0, mlp="gelu")
            >>> d = ModelDesc.from_config(dense, seq_len=64, batch_size=32)
            >>> d.is_moe, d.mlp, d.dense_mlp_params
            (False, 'gelu', 16384)
        """
        moe = model.num_experts > 0
        mlp = getattr(model, "mlp", "swiglu")
        return cls(name=name, vocab_size=model.vocab_size, d_model=model.d_model,
                   num_layers=model.num_layers, num_heads=model.num_heads, d_ff=model.d_ff,
                   num_kv_heads=model.num_kv_heads,
                   mlp=mlp, expert_mlp="swiglu" if moe and mlp != "swiglu" else None,
                   num_experts=model.num_experts if moe else 1,
                   top_k=model.top_k if moe else 1,
                   num_shared_experts=model.num_shared_experts if moe else 0,
                   dense_layers=getattr(model, "dense_layers", 0) if moe else 0,
                   capacity_factor=model.capacity_factor, seq_len=seq_len,
                   batch_size=batch_size, compute_dtype=model.dtype,
                   remat=getattr(model, "remat", None),
                   attention=getattr(model, "attention", None))

    @classmethod
    def of_config(cls, config: Any, *, name: str = "meshkit") -> ModelDesc:
        """The description ``meshkit plan CONFIG`` ranks: meshkit's transformer as the
        config builds it (:meth:`buildable`'s choices: ``model.num_kv_heads``, SwiGLU
        experts, a dense MLP and the logits split over the tensor ways), with the
        config's remat, attention, schedule, ZeRO-1, node limit and ``moe_tensor`` fixed
        (``auto``: open, the planner tries ``tokens`` and ``ffn`` and names its pick),
        one micro-step a step (the config has no accumulation).

        Args:
            config: a :class:`meshkit.config.Config` (its mesh is not read).
            name: a label.

        Returns:
            The description.

        Examples:
            >>> from meshkit.config import load_config
            >>> d = ModelDesc.of_config(load_config(None))
            >>> d.megatron_tp, d.grad_accum, d.remat, d.schedule, d.moe_tensor
            (True, 1, 'none', 'gpipe', None)
        """
        m, p = config.model, config.parallel
        mode = getattr(p, "moe_tensor", "auto")
        return dataclasses.replace(
            cls.from_config(m, seq_len=config.train.seq_len,
                            batch_size=config.train.batch_size, name=name).buildable(),
            max_nodes=m.max_nodes, attention_chunk=m.attention_chunk, schedule=p.schedule,
            zero1=p.zero1, grad_accum=1,
            moe_tensor=mode if mode != "auto" and m.num_experts else None)

    def differences(self) -> list[str]:
        """What meshkit's own transformer cannot build of this model (what ``--verify``
        compiles instead).

        Returns:
            One short phrase per difference; empty when meshkit builds it as described.
        """
        out = []
        if self.head_dim is not None and self.head_dim * self.num_heads != self.d_model:
            out.append("head_dim × num_heads ≠ d_model compiled as d_model / num_heads")
        expert_mlp = self.expert_mlp or self.mlp
        if self.is_moe and expert_mlp != "swiglu":
            out.append(f"{expert_mlp} experts compiled as SwiGLU")
        if self.bias:
            out.append("biases left out")
        if self.tie_embeddings:
            out.append("tied embeddings compiled untied")
        if self.is_moe and self.dense_layers and self.d_ff != self.ff_expert:
            out.append(f"{self.dense_layers} dense layer(s) of d_ff {self.d_ff} compiled "
                       f"{self.ff_expert} wide (meshkit's one model.d_ff)")
        if self.is_moe and self.dense_layers:
            out.append(f"{self.dense_layers} dense layer(s) compiled as MoE layers in a "
                       "pipelined layout (meshkit splits no dense layers into stages)")
        if self.num_experts > 1 and not self.is_moe:
            out.append(f"{self.num_experts} experts in no MoE layer compiled as a dense "
                       "model")
        return out

    def buildable(self) -> ModelDesc:
        """This model as meshkit's transformer builds it from :meth:`overrides`: what
        ``--verify`` compiles (see :meth:`differences`).

        Returns:
            The description with its grouped-query attention (``model.num_kv_heads``),
            ``head_dim`` from the width, no biases, untied embeddings,
            the dense MLPs' kind kept (SwiGLU or GELU) and split over the tensor ways
            (``megatron_tp``); for an MoE model SwiGLU experts and one width,
            ``expert_d_ff``, for the experts and the dense layers it keeps.

        Examples:
            >>> d = ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2,
            ...               num_heads=4, num_kv_heads=2, d_ff=128, seq_len=16,
            ...               batch_size=8, mlp="gelu")
            >>> d.buildable().kv_heads, d.buildable().mlp, d.buildable().megatron_tp
            (2, 'gelu', True)
        """
        moe = self.is_moe
        return dataclasses.replace(
            self, head_dim=None, bias=False, tie_embeddings=False,
            expert_mlp="swiglu" if moe and self.mlp != "swiglu" else None,
            dense_layers=self.dense_layers if moe else 0, megatron_tp=True,
            d_ff=self.ff_expert if moe else self.d_ff, expert_d_ff=None,
            num_experts=self.num_experts if moe else 1, top_k=self.top_k if moe else 1,
            num_shared_experts=self.num_shared_experts if moe else 0,
            moe_tensor=self.moe_tensor if moe else None)

    def overrides(self, *, grad_accum: int = 1, remat: str | None = None,
                  attention: str | None = None,
                  known: frozenset[str] = frozenset()) -> list[str]:
        """``key=value`` overrides of meshkit's config that build this model (or the
        nearest meshkit can, see :meth:`differences`) with one micro-step's batch.

        Args:
            grad_accum: micro-steps per optimizer step (the batch compiled is
                ``batch_size / grad_accum``).
            remat, attention: the step's choices (default: the description's own).
            known: config keys the installed meshkit knows among ``model.remat``,
                ``model.attention``, ``model.attention_chunk``, ``parallel.zero1``: each
                is set only when listed (the planner's choices then reach the compiled
                step).

        Returns:
            The overrides.

        Examples:
            >>> ModelDesc(name="t", vocab_size=16, d_model=64, num_layers=2, num_heads=4,
            ...           d_ff=128, seq_len=64, batch_size=8).overrides()[:2]
            ['model.vocab_size=16', 'model.d_model=64']
        """
        dense = not self.is_moe
        out = [
            f"model.vocab_size={self.vocab_size}",
            f"model.d_model={self.d_model}",
            f"model.num_layers={self.num_layers}",
            f"model.num_heads={self.num_heads}",
            f"model.num_kv_heads={'null' if self.num_kv_heads is None else self.num_kv_heads}",
            f"model.d_ff={self.d_ff if dense else self.ff_expert}",
            # 0: a dense model, every layer a dense MLP (model.mlp).
            f"model.num_experts={0 if dense else self.num_experts}",
            f"model.top_k={1 if dense else self.top_k}",
            f"model.capacity_factor={self.capacity_factor}",  # unread by a dense model
            f"model.num_shared_experts={0 if dense else self.num_shared_experts}",
            f"model.dense_layers={0 if dense else self.dense_layers}",
            f"model.mlp={self.mlp}",
            f"model.dtype={self.compute_dtype}",
            f"train.batch_size={self.batch_size // grad_accum}",
            f"train.seq_len={self.seq_len}",
        ]
        remat, attention = remat or self.remat, attention or self.attention
        if remat is not None and "model.remat" in known:
            out.append(f"model.remat={remat}")
        if attention is not None and "model.attention" in known:
            out.append(f"model.attention={attention}")
        if self.attention_chunk is not None and "model.attention_chunk" in known:
            out.append(f"model.attention_chunk={self.attention_chunk}")
        if self.zero1 and "parallel.zero1" in known:
            out.append("parallel.zero1=true")
        return out


# A description file's fields: ``measured`` comes from measuring a model, not a file.
_FIELDS = {f.name: f for f in dataclasses.fields(ModelDesc) if f.name != "measured"}
_INTS = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "seq_len", "batch_size",
         "num_experts", "top_k")
_OPTIONAL_INTS = ("num_kv_heads", "head_dim", "expert_d_ff", "grad_accum", "attention_chunk",
                  "micro_batch_size", "max_nodes")
_CHOICES = {"mlp": MLP_KINDS, "param_dtype": DTYPES, "compute_dtype": DTYPES,
            "optimizer_dtype": DTYPES}
_OPTIONAL_CHOICES = {"remat": REMAT_POLICIES, "attention": ATTENTION_KINDS,
                     "schedule": PIPELINE_SCHEDULES, "expert_mlp": MLP_KINDS,
                     # auto is the config's "let the planner pick": None here.
                     "moe_tensor": MOE_TENSOR_MODES[1:]}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(m: ModelDesc) -> None:
    """Every field's type and range, and the rules between them: one line each."""
    for name in _INTS:
        v = getattr(m, name)
        if not _is_int(v) or v < 1:
            raise ModelDescError(f"{name}: must be a positive integer, got {v!r}")
    for name in _OPTIONAL_INTS:
        v = getattr(m, name)
        if v is not None and (not _is_int(v) or v < 1):
            raise ModelDescError(f"{name}: must be a positive integer or null, got {v!r}")
    for name in ("num_shared_experts", "dense_layers"):
        v = getattr(m, name)
        if not _is_int(v) or v < 0:
            raise ModelDescError(f"{name}: must be an integer >= 0, got {v!r}")
    for name, allowed in _CHOICES.items():
        if getattr(m, name) not in allowed:
            raise ModelDescError(f"{name}: must be one of {', '.join(allowed)}, "
                                 f"got {getattr(m, name)!r}")
    for name, allowed in _OPTIONAL_CHOICES.items():
        v = getattr(m, name)
        if v is not None and v not in allowed:
            raise ModelDescError(f"{name}: must be one of {', '.join(allowed)} or null, "
                                 f"got {v!r}")
    for name in ("bias", "tie_embeddings", "megatron_tp", "zero1"):
        if not isinstance(getattr(m, name), bool):
            raise ModelDescError(f"{name}: must be true or false, got {getattr(m, name)!r}")
    if m.measured is not None and not isinstance(m.measured, Measured):
        raise ModelDescError(f"measured: must be a Measured, got {type(m.measured).__name__}")
    for name in ("name", "source"):
        if not isinstance(getattr(m, name), str):
            raise ModelDescError(f"{name}: must be a string, got {getattr(m, name)!r}")
    cf = m.capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, int | float) or cf < 0:
        raise ModelDescError(f"capacity_factor: must be a number >= 0 (0 = dropless), "
                             f"got {cf!r}")
    if m.num_kv_heads is not None and m.num_heads % m.num_kv_heads:
        raise ModelDescError(f"num_kv_heads: {m.num_kv_heads} does not divide "
                             f"num_heads={m.num_heads} (each group of query heads shares "
                             "one key/value head)")
    if m.head_dim is None and m.d_model % m.num_heads:
        raise ModelDescError(f"num_heads: {m.num_heads} does not divide d_model={m.d_model} "
                             "(or give head_dim)")
    if m.top_k > m.num_experts:
        raise ModelDescError(f"top_k: {m.top_k} is more than num_experts={m.num_experts}")
    if m.dense_layers > m.num_layers:
        raise ModelDescError(f"dense_layers: {m.dense_layers} is more than "
                             f"num_layers={m.num_layers}")
    if m.grad_accum is not None and m.batch_size % m.grad_accum:
        raise ModelDescError(f"grad_accum: {m.grad_accum} does not divide "
                             f"batch_size={m.batch_size}")
    if m.micro_batch_size is not None and m.micro_batch_size > m.batch_size:
        raise ModelDescError(f"micro_batch_size: {m.micro_batch_size} is more than "
                             f"batch_size={m.batch_size}")
    if m.attention == "chunked":
        from meshkit.config.rules import attention_chunk_problem

        problem = attention_chunk_problem(m.attention_chunk or default_attention_chunk(),
                                          m.seq_len, seq_key="seq_len")
        if problem:
            raise ModelDescError(f"attention_chunk: {problem}")


@functools.cache
def default_attention_chunk() -> int:
    """The chunk length of ``chunked`` attention when a description leaves it open: the
    config's ``model.attention_chunk`` default, read from its schema so that the planner
    and the step ``--verify`` compiles use one figure.

    Returns:
        Keys per block.

    Examples:
        >>> default_attention_chunk() >= 1
        True
    """
    from meshkit.config.sections import ModelConfig  # pydantic, not JAX

    return int(ModelConfig.model_fields["attention_chunk"].default)


def load_model_desc(path: str | os.PathLike[str]) -> ModelDesc:
    """Read a model description from a YAML file of flat ``field: value`` pairs.

    Args:
        path: the file (``configs/models/llama2_7b.yaml``, ...).

    Returns:
        The :class:`ModelDesc`.

    Raises:
        ModelDescError: a missing file, one that is not a regular file or is over
            :data:`meshkit._fs.MAX_TEXT_FILE_BYTES`, invalid YAML, not a mapping, an
            unknown or missing field, or a bad value, as one line naming the field.

    Example::

        load_model_desc("configs/models/llama2_7b.yaml").params  # 6,738,415,616
    """
    from meshkit._fs import read_text_file
    from meshkit._yamlfile import YAMLFileError, load_yaml

    where = os.fspath(path)
    try:
        raw: Any = load_yaml(read_text_file(where, what="--model file"), where=where)
    except (UsageError, YAMLFileError) as e:
        raise ModelDescError(str(e)) from None
    if not isinstance(raw, dict):
        raise ModelDescError(f"{where}: a model description is a mapping of fields, got "
                             f"{type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _FIELDS)
    if unknown:
        raise ModelDescError(f"{unknown[0]}: unknown field in {where} (known: "
                             f"{', '.join(_FIELDS)})")
    missing = [n for n, f in _FIELDS.items()
               if f.default is dataclasses.MISSING and n not in raw]
    if missing:
        raise ModelDescError(f"{missing[0]}: missing from {where}")
    try:
        return ModelDesc(**raw)
    except ModelDescError as e:
        raise ModelDescError(f"{e} (in {where})") from None
