"""Training data: a synthetic Markov source with an exact entropy rate, byte text, token files.

Every dataset answers ``batch(step, batch_size, seq_len, seed=..., split=...)`` with an
int32 array of shape ``[batch_size, seq_len + 1]``: inputs are ``[:, :-1]`` and targets
``[:, 1:]``. A batch is a pure function of ``(seed, step, split)``, so a run resumed from a
checkpoint at step ``s`` sees exactly the batches an uninterrupted run would have seen.
``rows=(start, stop)`` returns only those rows of the same batch, drawing and reading
nothing else, so each process of a multi-process run loads only its own devices' rows.

This module is numpy only: the training loop places batches on the mesh itself.

Examples:
    >>> src = make_dataset("markov", path=None, vocab_size=8, order=1, seed=0,
    ...                    concentration=0.5)
    >>> src.batch(0, batch_size=4, seq_len=16, seed=1).shape
    (4, 17)
    >>> 0.0 < src.entropy_rate() < float(np.log(8))
    True
"""

from __future__ import annotations

import math
import operator
import os
from typing import Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from meshkit.choices import DATA_KINDS, TOKEN_DTYPES

__all__ = [
    "DATASET_KINDS",
    "EVAL_FRACTION",
    "RAW_DTYPE",
    "Dataset",
    "MarkovSource",
    "TextBytes",
    "TokenFile",
    "make_dataset",
]

DATASET_KINDS = DATA_KINDS
"""The values ``make_dataset`` accepts for ``kind``."""

EVAL_FRACTION = 0.1
"""File datasets: the last 10% of the file is the eval split, the first 90% the train split."""

RAW_DTYPE = "uint16"
"""A raw (headerless) token file's dtype when none is given; a ``.npy`` file has its own."""

_SPLIT_IDS = {"train": 0, "eval": 1}
# Tokens per pass of a token file's range check: 64 MiB of int32 in memory at a time.
_SCAN_CHUNK = 2**24
_MAX_VOCAB = 2**31  # ids up to 2**31 - 1 fit the int32 batches

# SeedSequence pads short entropy with zeros, so [s] and [s, 0, 0] give the same stream. A
# fixed-length key ending in a non-zero tag can never collide with the table's plain seed
# nor with another (seed, step, split).
_BATCH_KEY_TAG = 0x6D6B6461  # "mkda"

_MAX_CONTEXTS = 2**20  # V**k states of the context chain
_MAX_TABLE_ENTRIES = 2**24  # V**(k+1) float64 entries: 128 MiB, plus as much for the CDF
_DENSE_SOLVE_MAX_STATES = 2048  # above this, a dense [S, S] solve costs too much
_POWER_TOL = 1e-13  # L1 residual |pi P - pi|_1 at which power iteration stops
# Iterations are capped by total work (table entries touched), so a chain that mixes too
# slowly fails within about half a minute, not hours.
_POWER_WORK = 2**31
_POWER_MAX_ITERS = 100_000
_POWER_LAZINESS = 0.1  # weight kept on the old vector: makes periodic chains converge
# Dirichlet draws with small concentration underflow to exact zeros, which can make the
# chain reducible (no unique stationary distribution). A floor this small keeps every
# transition possible without moving the entropy rate by a measurable amount.
_TRANSITION_FLOOR = 1e-12


@runtime_checkable
class Dataset(Protocol):
    """What the training loop needs from a data source.

    Examples:
        >>> isinstance(MarkovSource(4, 1, seed=0, concentration=1.0), Dataset)
        True
    """

    @property
    def vocab_size(self) -> int:
        """Number of token ids; every token is in ``[0, vocab_size)``.

        Returns:
            The vocabulary size ``V`` (256 for byte-level text).

        Examples:
            >>> MarkovSource(4, 1, seed=0, concentration=1.0).vocab_size
            4
        """
        ...

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        seed: int,
        split: str = "train",
        rows: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Return int32 ``[batch_size, seq_len + 1]`` tokens, a pure function of the key.

        Args:
            step: training step (``>= 0``); part of the key.
            batch_size: rows in the batch.
            seq_len: model sequence length; each row holds ``seq_len + 1`` tokens.
            seed: run seed (``>= 0``); part of the key.
            split: ``"train"`` or ``"eval"``; part of the key.
            rows: ``(start, stop)``: only rows ``start:stop`` of that batch, computed
                without the others (``None``: all of them).

        Returns:
            int32 array of shape ``[batch_size, seq_len + 1]`` (``[stop - start, ...]``
            with ``rows``): inputs are ``[:, :-1]``, targets ``[:, 1:]``.

        Raises:
            ValueError: an argument out of range or of the wrong type (the message names
                it), an unknown ``split``, or a split too short for ``seq_len``.

        Examples:
            >>> ds: Dataset = MarkovSource(4, 1, seed=0, concentration=1.0)
            >>> ds.batch(0, batch_size=2, seq_len=3, seed=0).shape
            (2, 4)
            >>> ds.batch(0, batch_size=4, seq_len=3, seed=0, rows=(1, 3)).shape
            (2, 4)
        """
        ...

    def check_seq_len(self, seq_len: int) -> None:
        """Check, before training starts, that rows of ``seq_len + 1`` tokens can be drawn.

        Args:
            seq_len: model sequence length.

        Raises:
            ValueError: ``seq_len < 1``, or a split of a file dataset is too short.

        Examples:
            >>> MarkovSource(4, 1, seed=0, concentration=1.0).check_seq_len(0)
            Traceback (most recent call last):
            ...
            ValueError: seq_len must be >= 1, got 0
        """
        ...

    def entropy_rate(self) -> float | None:
        """The best achievable loss in nats per token, or ``None`` if unknown.

        Returns:
            The source's entropy rate (a floor for the model's cross-entropy), or
            ``None`` for real data.

        Examples:
            >>> src = MarkovSource.from_table([[0.5, 0.5], [0.5, 0.5]], order=1)
            >>> round(src.entropy_rate(), 4)  # ln 2: a fair coin
            0.6931
        """
        ...


# --------------------------------------------------------------------------- validation


def _as_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int ``>= minimum``, or raise naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)  # type: ignore[arg-type]  # a non-index raises TypeError
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _split_id(split: str) -> int:
    if split not in _SPLIT_IDS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
    return _SPLIT_IDS[split]


def _batch_rng(seed: int, step: int, split: str) -> np.random.Generator:
    """The generator for one batch, keyed so resumed runs replay the same data."""
    key = [_as_int("seed", seed, 0), _as_int("step", step, 0), _split_id(split)]
    return np.random.default_rng([*key, _BATCH_KEY_TAG])


def _check_batch_shape(batch_size: int, seq_len: int) -> tuple[int, int]:
    return _as_int("batch_size", batch_size, 1), _as_int("seq_len", seq_len, 1)


def _check_rows(rows: tuple[int, int] | None, batch_size: int) -> tuple[int, int]:
    """``rows`` as ``(start, stop)`` with ``0 <= start < stop <= batch_size``."""
    if rows is None:
        return 0, batch_size
    if not isinstance(rows, tuple | list) or len(rows) != 2:
        raise ValueError(f"rows must be a (start, stop) pair, got {rows!r}")
    start, stop = _as_int("rows start", rows[0], 0), _as_int("rows stop", rows[1], 1)
    if not start < stop <= batch_size:
        raise ValueError(
            f"rows=({start}, {stop}) must satisfy 0 <= start < stop <= batch_size={batch_size}"
        )
    return start, stop


# ------------------------------------------------------------------------------- Markov


def _next_state_flow(pi: np.ndarray, table: np.ndarray, vocab: int) -> np.ndarray:
    """One step of the context chain: ``pi @ P`` without building ``P``.

    Context ``s = (t1, .., tk)`` (t1 oldest, base-V digits, t1 most significant) moves to
    ``(t2, .., tk, x)`` with probability ``table[s, x]``; every successor of contexts that
    differ only in ``t1`` is the same, so the mass is a sum over the leading digit.
    """
    flow = pi[:, None] * table  # [S, V]: mass moving from s on token x
    return flow.reshape(vocab, -1).sum(axis=0)  # [(t1), (t2..tk, x)] -> (t2..tk, x)


def _stationary_dense(table: np.ndarray) -> np.ndarray:
    """Exact stationary vector by a linear solve of ``pi (P - I) = 0, sum(pi) = 1``."""
    n_states, vocab = table.shape
    rest = n_states // vocab  # V**(k-1)
    s = np.arange(n_states)
    succ = (s % rest)[:, None] * vocab + np.arange(vocab)[None, :]
    p = np.zeros((n_states, n_states))
    p[s[:, None], succ] = table  # the V successors of a context are distinct
    a = p.T - np.eye(n_states)
    # One balance equation is redundant; the normalisation takes its place.
    a[-1, :] = 1.0
    b = np.zeros(n_states)
    b[-1] = 1.0
    try:
        pi = np.linalg.solve(a, b)
    except np.linalg.LinAlgError:  # exactly singular: several closed classes
        pi = np.full(n_states, np.nan)
    # A nearly singular solve returns garbage instead of raising; the residual catches it.
    if not np.all(np.isfinite(pi)) or pi.min() < -1e-9 or np.abs(pi @ p - pi).sum() > 1e-8:
        raise ValueError(
            "transition table has no unique stationary distribution (chain is reducible)"
        )
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


def _stationary_power(table: np.ndarray) -> np.ndarray:
    """Stationary vector by power iteration, ``O(V**(k+1))`` per step.

    The slightly lazy step ``pi <- b pi + (1 - b) pi P`` has the same fixed point and
    converges even for periodic chains, at little cost for well-mixing ones.
    """
    n_states, vocab = table.shape
    max_iters = min(_POWER_MAX_ITERS, max(1, _POWER_WORK // table.size))
    pi = np.full(n_states, 1.0 / n_states)
    residual = np.inf
    for _ in range(max_iters):
        nxt = _next_state_flow(pi, table, vocab)
        residual = float(np.abs(nxt - pi).sum())
        if residual <= _POWER_TOL:
            return nxt / nxt.sum()
        pi = _POWER_LAZINESS * pi + (1.0 - _POWER_LAZINESS) * nxt
    raise RuntimeError(
        f"stationary distribution did not converge in {max_iters} iterations "
        f"({n_states} contexts, L1 residual {residual:.1e}); the chain mixes too slowly: "
        "raise concentration or lower order"
    )


class MarkovSource:
    """A synthetic order-k Markov chain over a small vocabulary, with a known entropy rate.

    The transition table ``table[s, x] = P(next = x | context = s)`` has shape
    ``[vocab_size**order, vocab_size]``; context ``s`` encodes the last ``order`` tokens
    ``(t1, .., tk)`` (oldest first) as ``sum_i t_i * V**(k - i)``. Each row is drawn from a
    symmetric Dirichlet(``concentration``) by ``np.random.default_rng(seed)``: a small
    concentration puts most mass on a few tokens per context, so the source has low entropy
    and is learnable; a large one approaches uniform noise (entropy ``log V``).

    Every sequence starts from the stationary distribution of contexts, so the entropy rate
    is the best achievable loss from the first predicted token on.

    Args:
        vocab_size: number of symbols ``V >= 2``.
        order: context length ``k >= 1``.
        seed: seed of the transition table (``>= 0``); batch seeds are separate.
        concentration: Dirichlet concentration (``> 0``, finite).

    Raises:
        ValueError: an argument is out of range (the message names it), or ``V**k``
            contexts / ``V**(k+1)`` table entries exceed the caps (2**20 / 2**24).

    Examples:
        >>> src = MarkovSource(vocab_size=32, order=2, seed=0, concentration=0.1)
        >>> src.batch(step=0, batch_size=2, seq_len=8, seed=0).shape
        (2, 9)
        >>> src.entropy_rate() < float(np.log(32))
        True
    """

    vocab_size: int
    order: int
    seed: int | None
    concentration: float | None
    table: np.ndarray

    def __init__(self, vocab_size: int, order: int, seed: int, concentration: float) -> None:
        vocab = _as_int("vocab_size", vocab_size, 2)
        k = _as_int("order", order, 1)
        seed = _as_int("seed", seed, 0)
        _check_size(vocab, k)
        try:
            conc = float(concentration)
        except (TypeError, ValueError):
            raise ValueError(f"concentration must be a number, got {concentration!r}") from None
        if not (np.isfinite(conc) and conc > 0):
            raise ValueError(f"concentration must be finite and > 0, got {concentration!r}")
        rng = np.random.default_rng(seed)
        table = rng.dirichlet(np.full(vocab, conc), size=vocab**k)
        table = (table + _TRANSITION_FLOOR) / (1.0 + vocab * _TRANSITION_FLOOR)
        self._setup(table, k)
        self.seed = seed
        self.concentration = conc

    @classmethod
    def from_table(cls, table: npt.ArrayLike, order: int) -> MarkovSource:
        """Build a source from a given transition table (for tests and hand-made chains).

        Args:
            table: ``[V**order, V]`` non-negative rows that each sum to 1.
            order: context length ``k >= 1``.

        Returns:
            A ``MarkovSource`` with ``seed`` and ``concentration`` set to ``None``.

        Raises:
            ValueError: wrong shape, negative entries, rows not summing to 1, or sizes
                over the caps. ``stationary()`` raises ``ValueError`` later if the chain
                has no unique stationary distribution (detected up to 2048 contexts;
                above, power iteration returns one of the stationary vectors).

        Examples:
            >>> src = MarkovSource.from_table([[0.9, 0.1], [0.5, 0.5]], order=1)
            >>> src.stationary().round(4).tolist()
            [0.8333, 0.1667]
        """
        k = _as_int("order", order, 1)
        arr = np.asarray(table, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] < 2:
            raise ValueError(f"table must have shape [V**order, V] with V >= 2, got {arr.shape}")
        vocab = arr.shape[1]
        _check_size(vocab, k)
        if arr.shape[0] != vocab**k:
            raise ValueError(
                f"table has {arr.shape[0]} rows, expected vocab**order = {vocab}**{k} = {vocab**k}"
            )
        if not np.all(np.isfinite(arr)) or arr.min() < 0:
            raise ValueError("table entries must be finite and >= 0")
        if not np.allclose(arr.sum(axis=1), 1.0, rtol=0, atol=1e-9):
            raise ValueError("table rows must each sum to 1")
        src = cls.__new__(cls)
        src._setup(arr / arr.sum(axis=1, keepdims=True), k)
        src.seed = None
        src.concentration = None
        return src

    def _setup(self, table: np.ndarray, order: int) -> None:
        self.table = table
        self.table.setflags(write=False)
        self.vocab_size = table.shape[1]
        self.order = order
        cdf = np.cumsum(table, axis=1)
        cdf[:, -1] = 1.0  # so a uniform in [0, 1) never falls past the last symbol
        self._cdf = cdf
        self._pi: np.ndarray | None = None
        self._pi_cdf: np.ndarray | None = None

    def __repr__(self) -> str:
        return (
            f"MarkovSource(vocab_size={self.vocab_size}, order={self.order}, "
            f"seed={self.seed}, concentration={self.concentration})"
        )

    @property
    def num_contexts(self) -> int:
        """Number of contexts ``V**order`` (states of the context chain)."""
        return self.table.shape[0]

    def stationary(self) -> np.ndarray:
        """Stationary distribution of the context chain, shape ``[V**order]``.

        The context chain moves ``(t1, .., tk) -> (t2, .., tk, x)`` with probability
        ``table[s, x]``. Up to 2048 contexts it is solved exactly (dense linear solve);
        above, by power iteration that exploits this structure (``O(V**(k+1))`` per step)
        to an L1 residual of 1e-13. The result is cached.

        Returns:
            A copy of ``pi``, non-negative, summing to 1; index ``s`` as in ``table``.

        Raises:
            ValueError: the chain has no unique stationary distribution (only possible
                with ``from_table``).
            RuntimeError: power iteration did not converge.

        Examples:
            >>> MarkovSource.from_table([[0.0, 1.0], [1.0, 0.0]], order=1).stationary()
            array([0.5, 0.5])
        """
        if self._pi is None:
            if self.num_contexts <= _DENSE_SOLVE_MAX_STATES:
                self._pi = _stationary_dense(self.table)
            else:
                self._pi = _stationary_power(self.table)
        return self._pi.copy()

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats per token.

        ``H = sum_s pi(s) * H(table[s])`` with ``H(p) = -sum_x p_x log p_x`` (``0 log 0 =
        0``) and ``pi`` the stationary distribution of contexts. Because sequences start in
        ``pi``, this is the expected per-token loss of the true model at every position, so
        it is the floor for a model's cross-entropy.

        Returns:
            The entropy rate, in ``[0, log(vocab_size)]``.

        Examples:
            >>> MarkovSource.from_table([[0.5, 0.5], [0.5, 0.5]], order=1).entropy_rate()
            0.6931471805599453
        """
        t = self.table
        logs = np.log(t, out=np.zeros_like(t), where=t > 0)
        row_entropy = -(t * logs).sum(axis=1)
        return float(self.stationary() @ row_entropy)

    def check_seq_len(self, seq_len: int) -> None:
        """Validate ``seq_len`` (any positive length can be sampled).

        Args:
            seq_len: model sequence length.

        Raises:
            ValueError: ``seq_len < 1``.

        Examples:
            >>> MarkovSource(4, 1, seed=0, concentration=1.0).check_seq_len(128)
        """
        _as_int("seq_len", seq_len, 1)

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        seed: int,
        split: str = "train",
        rows: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Sample ``batch_size`` independent sequences of ``seq_len + 1`` tokens.

        Rows start from a stationary context; each further token is drawn by inverse CDF
        on ``table``, vectorised over the batch (a 64 x 128 batch takes milliseconds).
        ``"train"`` and ``"eval"`` use distinct keyed streams of the same source.

        Args:
            step: training step (``>= 0``).
            batch_size: rows (``>= 1``).
            seq_len: model sequence length (``>= 1``).
            seed: batch seed (``>= 0``), independent of the table's seed.
            split: ``"train"`` or ``"eval"``.
            rows: ``(start, stop)``: sample only these rows of the batch (the generator
                skips the others' draws), equal to ``batch(...)[start:stop]``.

        Returns:
            int32 array ``[batch_size, seq_len + 1]`` (``[stop - start, seq_len + 1]``
            with ``rows``), a pure function of ``(seed, step, split)``.

        Raises:
            ValueError: an argument is out of range (the message names it).

        Examples:
            >>> src = MarkovSource(4, 2, seed=0, concentration=0.5)
            >>> a = src.batch(3, 2, 5, seed=7)
            >>> bool((a == src.batch(3, 2, 5, seed=7)).all()), a.dtype
            (True, dtype('int32'))
            >>> part = src.batch(3, 4, 5, seed=7, rows=(1, 3))
            >>> bool((part == src.batch(3, 4, 5, seed=7)[1:3]).all())
            True
        """
        batch_size, seq_len = _check_batch_shape(batch_size, seq_len)
        start, stop = _check_rows(rows, batch_size)
        rng = _batch_rng(seed, step, split)
        if self._pi_cdf is None:
            pi_cdf = np.cumsum(self.stationary())
            pi_cdf[-1] = 1.0
            self._pi_cdf = pi_cdf
        vocab, k, length = self.vocab_size, self.order, seq_len + 1
        rest = self.num_contexts // vocab  # V**(k-1): drops the oldest token of a context
        n, width = stop - start, max(length - k, 0)
        out = np.empty((n, max(length, k)), dtype=np.int32)

        # The whole batch's stream is batch_size start draws, then batch_size rows of
        # `width` draws; every double is one 64-bit draw, so advancing the generator past
        # other rows' draws gives exactly the values the whole batch would hold.
        bits = cast(np.random.PCG64, rng.bit_generator)  # default_rng's, has advance()
        bits.advance(start)
        ctx = np.searchsorted(self._pi_cdf, rng.random(n), side="right")
        for i in range(k):  # the context's base-V digits, oldest token first
            out[:, i] = (ctx // vocab ** (k - 1 - i)) % vocab
        bits.advance(batch_size - stop + start * width)
        u = rng.random((n, width))
        for t in range(k, length):
            x = (self._cdf[ctx] <= u[:, t - k, None]).sum(axis=1)
            out[:, t] = x
            ctx = (ctx % rest) * vocab + x
        return out[:, :length]


def _power(base: int, exponent: int, cap: int) -> str | None:
    """``base**exponent`` written out if it exceeds ``cap``, else ``None``.

    Decided on logarithms first: with ``exponent`` up to 2**31 the power itself would
    take gigabytes to compute, and its digits would flood the message.
    """
    if exponent * math.log2(base) <= 64:
        value = base**exponent
        return str(value) if value > cap else None
    return f"about 10^{exponent * math.log10(base):,.0f}"  # far above any cap


def _check_size(vocab: int, order: int) -> None:
    contexts = _power(vocab, order, _MAX_CONTEXTS)
    if contexts is not None:
        raise ValueError(
            f"vocab_size**order = {vocab}**{order} = {contexts} contexts exceeds the cap of "
            f"{_MAX_CONTEXTS}; lower vocab_size or order"
        )
    entries = _power(vocab, order + 1, _MAX_TABLE_ENTRIES)
    if entries is not None:
        raise ValueError(
            f"vocab_size**(order+1) = {vocab}**{order + 1} = {entries} table entries exceeds "
            f"the cap of {_MAX_TABLE_ENTRIES}; lower vocab_size or order"
        )


# -------------------------------------------------------------------------------- files


def _existing_file(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, or ``FileNotFoundError`` naming it."""
    out = os.fspath(path)
    if not os.path.isfile(out):
        raise FileNotFoundError(f"data file {out!r} does not exist or is not a file")
    return out


def _raw_tokens(path: str, dtype: np.dtype) -> np.memmap:
    """Map a headerless file of ``dtype`` values; every byte of it is token data."""
    nbytes = os.path.getsize(path)
    if nbytes == 0:
        raise ValueError(f"data file {path!r} is empty")
    if nbytes % dtype.itemsize:
        raise ValueError(
            f"data file {path!r} has {nbytes} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype.name} tokens)"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _is_npy(path: str) -> bool:
    """Whether ``path`` is a ``.npy`` file: by its name, or by its magic bytes.

    The magic catches a ``.npy`` saved under another name, whose header a raw read would
    turn into tokens.
    """
    if path.lower().endswith(".npy"):
        return True
    magic = np.lib.format.MAGIC_PREFIX
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _npy_tokens(path: str, dtype: str | None) -> np.ndarray:
    """Map a ``.npy`` file's 1-d integer array (its header read by numpy, never as tokens)."""
    magic = np.lib.format.MAGIC_PREFIX
    with open(path, "rb") as f:
        if f.read(len(magic)) != magic:
            raise ValueError(
                f"data file {path!r} is named .npy but has no .npy header; a raw token "
                "file needs another name (e.g. .bin)"
            )
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # a damaged header, an object array
        raise ValueError(f"data file {path!r} is not a readable .npy file: {e}") from None
    if not (isinstance(tokens, np.ndarray) and tokens.ndim == 1
            and np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(
            f"data file {path!r} holds an array of dtype {tokens.dtype} and shape "
            f"{tokens.shape}; token ids must be a 1-d array of integers"
        )
    if dtype is not None and np.dtype(dtype).name != tokens.dtype.name:  # byte order aside
        raise ValueError(
            f"data file {path!r} holds {tokens.dtype.name} tokens (its .npy header), but "
            f"dtype={dtype!r} was given; leave dtype unset or make it {tokens.dtype.name!r}"
        )
    if tokens.size == 0:
        raise ValueError(f"data file {path!r} is empty (its .npy array has no tokens)")
    return tokens


def _check_token_range(tokens: np.ndarray, path: str, vocab_size: int) -> None:
    """Raise naming the first token outside ``[0, vocab_size)``, its position and value.

    Runs over the memory map ``_SCAN_CHUNK`` tokens at a time, so a file of many GB
    never sits in memory whole; a dtype that cannot hold a bad id skips the scan.
    """
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    for start in range(0, tokens.shape[0], _SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
        if chunk.min() >= 0 and chunk.max() < vocab_size:
            continue
        at = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
        value, position = int(chunk[at]), start + at
        if value < 0:
            raise ValueError(
                f"data file {path!r} holds token {value} at position {position}; token ids "
                "must be >= 0"
            )
        raise ValueError(
            f"data file {path!r} holds token {value} at position {position}, not below "
            f"vocab_size={vocab_size}"
        )


class _FileTokens:
    """Random windows from a token array on disk; train = first 90%, eval = last 10%."""

    path: str
    vocab_size: int

    def __init__(self, path: str, tokens: np.ndarray, vocab_size: int) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self._tokens = tokens
        n = self._tokens.shape[0]
        n_train = int(n * (1.0 - EVAL_FRACTION))
        self._parts = {"train": (0, n_train), "eval": (n_train, n - n_train)}

    def __len__(self) -> int:
        return int(self._tokens.shape[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size})"

    def entropy_rate(self) -> None:
        """Unknown for real data: always ``None``.

        Returns:
            ``None``.

        Examples:
            >>> import tempfile, pathlib
            >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = p.write_text("hi")
            >>> TextBytes(p).entropy_rate() is None
            True
        """
        return None

    def check_seq_len(self, seq_len: int) -> None:
        """Check that both splits hold at least ``seq_len + 1`` tokens.

        Args:
            seq_len: model sequence length.

        Raises:
            ValueError: ``seq_len < 1``, or the train or eval part is too short (the
                message names the path, the split and both lengths).

        Examples:
            >>> import tempfile, pathlib
            >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = p.write_text("x" * 100)
            >>> TextBytes(p).check_seq_len(8)
        """
        for split in _SPLIT_IDS:
            self._part(split, _as_int("seq_len", seq_len, 1) + 1)

    def _part(self, split: str, length: int) -> tuple[int, int]:
        _split_id(split)
        offset, size = self._parts[split]
        if size < length:
            where = "last 10%" if split == "eval" else "first 90%"
            raise ValueError(
                f"data file {self.path!r}: the {split} split (the {where} of its "
                f"{len(self)} tokens) holds {size} tokens, fewer than seq_len + 1 = {length}"
            )
        return offset, size

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        seed: int,
        split: str = "train",
        rows: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Draw ``batch_size`` random windows of ``seq_len + 1`` tokens from one split.

        Windows lie wholly inside their split ("train": the first 90% of the file,
        "eval": the last 10%), so no eval token is ever trained on. Start positions are
        uniform and drawn with replacement.

        Args:
            step: training step (``>= 0``).
            batch_size: rows (``>= 1``).
            seq_len: model sequence length (``>= 1``).
            seed: run seed (``>= 0``).
            split: ``"train"`` or ``"eval"``.
            rows: ``(start, stop)``: read only these rows' windows (every row's start
                position is drawn, a few integers, so the rows equal the whole batch's).

        Returns:
            int32 array ``[batch_size, seq_len + 1]`` (``[stop - start, seq_len + 1]``
            with ``rows``), a pure function of ``(seed, step, split)``.

        Raises:
            ValueError: an argument is out of range, or the split is shorter than
                ``seq_len + 1`` tokens (the message names the path).

        Examples:
            >>> import tempfile, pathlib
            >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = p.write_text("ab" * 50)
            >>> TextBytes(p).batch(0, 2, 4, seed=0).shape
            (2, 5)
        """
        batch_size, seq_len = _check_batch_shape(batch_size, seq_len)
        start, stop = _check_rows(rows, batch_size)
        rng = _batch_rng(seed, step, split)
        length = seq_len + 1
        offset, size = self._part(split, length)
        # Bounded integers take a variable number of draws, so every row's start is
        # drawn; only the windows of the wanted rows are read.
        starts = offset + rng.integers(0, size - length + 1, size=batch_size)[start:stop]
        return np.asarray(self._tokens[starts[:, None] + np.arange(length)], dtype=np.int32)


class TextBytes(_FileTokens):
    """Byte-level text from a file: every byte is a token, ``vocab_size == 256``.

    The file is memory-mapped, not read. "train" windows come from the first 90% of the
    bytes and "eval" windows from the last 10%.

    Args:
        path: the text file.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is empty.

    Examples:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"; _ = p.write_text("hello " * 20)
        >>> ds = TextBytes(p)
        >>> ds.vocab_size, ds.batch(0, 1, 4, seed=0).dtype
        (256, dtype('int32'))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # Always raw bytes: a text file is never read as .npy, whatever it begins with.
        path = _existing_file(path)
        super().__init__(path, _raw_tokens(path, np.dtype("u1")), 256)


class TokenFile(_FileTokens):
    """A file of integer token ids: a ``.npy`` array, or a raw file of ``dtype`` values.

    A ``.npy`` file (named ``*.npy``, or any file that starts with the ``.npy`` magic) is
    opened with ``np.load(path, mmap_mode="r")``: numpy reads its header, so the header is
    never taken for tokens, and its 1-d array may have any integer dtype, signed or not,
    in either byte order. Any other file is raw little-endian ``dtype`` values with no
    header (e.g. ``arr.astype('<u2').tofile(path)``), ``uint16`` unless ``dtype`` says
    otherwise; ``vocab_size`` must then fit in ``dtype`` (a raw file of wider ids read as
    ``uint16`` would pass every other check).

    The file is memory-mapped, never read whole. Construction scans it once, in chunks, for
    a token outside ``[0, vocab_size)``. "train" windows come from the first 90% of the
    tokens and "eval" from the last 10%.

    Args:
        path: the token file.
        vocab_size: number of token ids, ``1 <= vocab_size <= 2**31`` (batches are int32).
        dtype: the ids' integer type, one of :data:`~meshkit.choices.TOKEN_DTYPES`;
            ``None``: a ``.npy`` file's own dtype, ``uint16`` for a raw file. For a
            ``.npy`` file it must equal the header's dtype.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: bad ``vocab_size`` or ``dtype``; a raw file that is empty or whose
            size is not a multiple of the dtype's itemsize; a ``.npy`` file that is not
            1-d, not of integers, empty, unreadable or of another dtype than ``dtype``; a
            token ``>= vocab_size`` or negative (the message names the path, the
            position and the value).

    Examples:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> np.arange(100, dtype="<u2").tofile(d / "t.bin")
        >>> TokenFile(d / "t.bin", vocab_size=100).batch(0, 2, 3, seed=0).shape
        (2, 4)
        >>> np.save(d / "t.npy", np.arange(70_000, dtype=np.uint32))
        >>> ds = TokenFile(d / "t.npy", vocab_size=70_000)
        >>> len(ds), ds.dtype
        (70000, dtype('uint32'))
        >>> try:
        ...     TokenFile(d / "t.npy", vocab_size=65_536)
        ... except ValueError as e:
        ...     print(str(e)[str(e).index("holds"):])
        holds token 65536 at position 65536, not below vocab_size=65536
    """

    dtype: np.dtype
    """The ids' integer type as stored (a raw file's is little-endian)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        vocab_size: int,
        dtype: str | None = None,
    ) -> None:
        vocab = _as_int("vocab_size", vocab_size, 1)
        if vocab > _MAX_VOCAB:
            raise ValueError(f"vocab_size must be <= {_MAX_VOCAB} (batches are int32), "
                             f"got {vocab}")
        if dtype is not None and dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        path = _existing_file(path)
        if _is_npy(path):
            tokens = _npy_tokens(path, dtype)
        else:
            raw = np.dtype(dtype or RAW_DTYPE).newbyteorder("<")
            ids = int(np.iinfo(raw).max) + 1
            if vocab > ids:
                raise ValueError(
                    f"vocab_size must be <= {ids} for {raw.name} tokens, got {vocab}; a raw "
                    "file of wider ids needs its dtype (data.dtype, e.g. uint32)"
                )
            tokens = _raw_tokens(path, raw)
        super().__init__(path, tokens, vocab)
        self.dtype = tokens.dtype
        _check_token_range(tokens, path, vocab)


# ------------------------------------------------------------------------------ factory


def make_dataset(
    kind: str,
    *,
    path: str | os.PathLike[str] | None,
    vocab_size: int,
    order: int,
    seed: int,
    concentration: float,
    dtype: str | None = None,
) -> Dataset:
    """Build the dataset a config's ``data`` section describes.

    Args:
        kind: ``"markov"``, ``"text"`` (bytes of ``path``) or ``"tokens"`` (integer ids in
            ``path``: a ``.npy`` array or a raw file, see :class:`TokenFile`).
        path: the data file; required for ``"text"`` and ``"tokens"``, ignored for Markov.
        vocab_size: the model's vocabulary; the Markov source's size, the token file's
            bound; for ``"text"`` it must be at least 256.
        order: Markov context length (Markov only).
        seed: Markov transition-table seed (Markov only).
        concentration: Markov Dirichlet concentration (Markov only).
        dtype: the token file's integer type (``"tokens"`` only): one of
            :data:`~meshkit.choices.TOKEN_DTYPES`, or ``None`` for a ``.npy`` file's own
            dtype and :data:`RAW_DTYPE` for a raw file.

    Returns:
        A ``Dataset``.

    Raises:
        ValueError: unknown ``kind`` (the message lists the valid ones); no ``path`` for a
            file kind (names ``data.path``); ``vocab_size < 256`` for text; or any error of
            the dataset's constructor.
        FileNotFoundError: ``path`` is not a file.

    Examples:
        >>> ds = make_dataset("markov", path=None, vocab_size=32, order=2, seed=0,
        ...                   concentration=0.1)
        >>> ds.vocab_size
        32
    """
    if kind not in DATASET_KINDS:
        raise ValueError(
            f"data.kind={kind!r} is not one of {', '.join(repr(k) for k in DATASET_KINDS)}"
        )
    if kind == "markov":
        return MarkovSource(vocab_size, order, seed=seed, concentration=concentration)
    if path is None or not os.fspath(path):
        raise ValueError(f"data.path is required for data.kind={kind!r}")
    if kind == "text":
        vocab = _as_int("vocab_size", vocab_size, 1)
        if vocab < 256:
            raise ValueError(
                f"vocab_size={vocab} is too small for byte-level text (data.kind='text' needs 256)"
            )
        return TextBytes(path)
    return TokenFile(path, vocab_size, dtype=dtype)
