"""Tests for meshkit.data.sources: keyed batches, exact Markov entropy rates, file datasets."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest

from meshkit.data import sources as data
from meshkit.data.sources import Dataset, MarkovSource, TextBytes, TokenFile, make_dataset


def _binary_entropy(p: float) -> float:
    return float(-(p * np.log(p) + (1 - p) * np.log(1 - p)))


@pytest.fixture
def token_path(tmp_path: Path) -> Path:
    # Token value == position, so a window's values tell where it came from.
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    return path


@pytest.fixture
def text_path(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 4)
    return path


@pytest.fixture
def datasets(token_path: Path, text_path: Path) -> dict[str, Dataset]:
    return {
        "markov": MarkovSource(vocab_size=8, order=2, seed=0, concentration=0.3),
        "text": TextBytes(text_path),
        "tokens": TokenFile(token_path, vocab_size=1000),
    }


# ------------------------------------------------------------------- common interface


@pytest.mark.parametrize("kind", data.DATASET_KINDS)
def test_shape_dtype_range(datasets: dict[str, Dataset], kind: str) -> None:
    ds = datasets[kind]
    assert isinstance(ds, Dataset)
    out = ds.batch(0, batch_size=5, seq_len=12, seed=0)
    assert out.shape == (5, 13)
    assert out.dtype == np.int32
    assert out.min() >= 0 and out.max() < ds.vocab_size


@pytest.mark.parametrize("kind", data.DATASET_KINDS)
def test_batch_is_pure_function_of_seed_step_split(
    datasets: dict[str, Dataset], kind: str, token_path: Path, text_path: Path
) -> None:
    ds = datasets[kind]
    first = ds.batch(7, 4, 16, seed=3, split="eval")
    ds.batch(8, 4, 16, seed=3)  # other calls in between must not disturb it
    fresh = {
        "markov": lambda: MarkovSource(8, 2, seed=0, concentration=0.3),
        "text": lambda: TextBytes(text_path),
        "tokens": lambda: TokenFile(token_path, 1000),
    }[kind]()
    np.testing.assert_array_equal(first, ds.batch(7, 4, 16, seed=3, split="eval"))
    np.testing.assert_array_equal(first, fresh.batch(7, 4, 16, seed=3, split="eval"))


@pytest.mark.parametrize("kind", data.DATASET_KINDS)
def test_steps_seeds_and_splits_differ(datasets: dict[str, Dataset], kind: str) -> None:
    ds = datasets[kind]
    base = ds.batch(0, 8, 16, seed=0)
    for other in (
        ds.batch(1, 8, 16, seed=0),
        ds.batch(0, 8, 16, seed=1),
        ds.batch(0, 8, 16, seed=0, split="eval"),
    ):
        assert not np.array_equal(base, other)


@pytest.mark.parametrize("kind", data.DATASET_KINDS)
@pytest.mark.parametrize("order", [1, 3])
def test_rows_of_a_batch_equal_the_whole_batchs_rows(
    datasets: dict[str, Dataset], kind: str, order: int
) -> None:
    ds = datasets[kind]
    if kind == "markov":  # order 3 > seq_len + 1 = 3: rows shorter than the context
        ds = MarkovSource(vocab_size=8, order=order, seed=0, concentration=0.3)
    for seq_len in (2, 16):
        whole = ds.batch(5, 8, seq_len, seed=2, split="eval")
        for start, stop in [(0, 8), (0, 1), (3, 5), (7, 8), (2, 8)]:
            part = ds.batch(5, 8, seq_len, seed=2, split="eval", rows=(start, stop))
            np.testing.assert_array_equal(part, whole[start:stop], err_msg=f"{start}:{stop}")


def test_rows_skip_the_other_rows_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Markov row is drawn, not sliced out of the whole batch: draws scale with the rows.
    src = MarkovSource(vocab_size=8, order=1, seed=0, concentration=0.3)
    drawn = []

    class Counting:
        def __init__(self, rng: np.random.Generator) -> None:
            self.bit_generator = rng.bit_generator
            self._rng = rng

        def random(self, size: object = None) -> object:
            out = self._rng.random(size)  # type: ignore[call-overload]
            drawn.append(np.size(out))
            return out

    original = data._batch_rng
    monkeypatch.setattr(data, "_batch_rng", lambda *key: Counting(original(*key)))
    src.batch(0, 64, 10, seed=0, rows=(16, 32))
    assert sum(drawn) == 16 * (1 + 10)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ((2, 2), r"rows=\(2, 2\) must satisfy 0 <= start < stop <= batch_size=4"),
        ((0, 5), r"rows=\(0, 5\) must satisfy 0 <= start < stop <= batch_size=4"),
        ((-1, 2), r"^rows start must be >= 0, got -1$"),
        ((0, 1.5), r"^rows stop must be an integer, got 1\.5$"),
        ((1,), r"^rows must be a \(start, stop\) pair, got \(1,\)$"),
        ("ab", r"^rows must be a \(start, stop\) pair, got 'ab'$"),
    ],
)
@pytest.mark.parametrize("kind", data.DATASET_KINDS)
def test_rows_errors(
    datasets: dict[str, Dataset], kind: str, rows: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        datasets[kind].batch(0, 4, 4, seed=0, rows=rows)  # type: ignore[arg-type]


def test_batch_stream_differs_from_table_stream() -> None:
    # [seed] and [seed, 0, 0] seed the same SeedSequence; the key tag prevents that.
    key_rng = data._batch_rng(5, 0, "train")
    assert key_rng.random() != np.random.default_rng(5).random()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": -1}, r"^step must be >= 0, got -1$"),
        ({"batch_size": 0}, r"^batch_size must be >= 1, got 0$"),
        ({"seq_len": 0}, r"^seq_len must be >= 1, got 0$"),
        ({"seed": -1}, r"^seed must be >= 0, got -1$"),
        ({"seed": True}, r"^seed must be an integer, got True$"),
        ({"seed": 1.5}, r"^seed must be an integer, got 1\.5$"),
        ({"split": "test"}, r"^split must be one of \['eval', 'train'\], got 'test'$"),
    ],
)
@pytest.mark.parametrize("kind", data.DATASET_KINDS)
def test_batch_argument_errors(
    datasets: dict[str, Dataset], kind: str, kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"step": 0, "batch_size": 2, "seq_len": 4, "seed": 0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        datasets[kind].batch(**args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- Markov


def test_markov_sampling_solves_for_the_stationary_distribution_once(monkeypatch) -> None:
    # The solve is the expensive part of sampling (a linear system over every context):
    # later batches must reuse it. Counted, not timed.
    src = MarkovSource(vocab_size=32, order=2, seed=0, concentration=0.1)
    calls = []
    solve = MarkovSource.stationary
    monkeypatch.setattr(MarkovSource, "stationary",
                        lambda self: calls.append(1) or solve(self))
    first = src.batch(0, 64, 128, seed=0)
    src.batch(1, 64, 128, seed=0)
    assert len(calls) == 1 and first.shape == (64, 129)


def test_table_rows_are_distributions_and_seeded() -> None:
    src = MarkovSource(vocab_size=6, order=2, seed=4, concentration=0.2)
    assert src.table.shape == (36, 6) and src.num_contexts == 36
    np.testing.assert_allclose(src.table.sum(axis=1), 1.0, atol=1e-12)
    assert src.table.min() > 0  # the floor keeps the chain irreducible
    np.testing.assert_array_equal(src.table, MarkovSource(6, 2, 4, 0.2).table)
    assert not np.array_equal(src.table, MarkovSource(6, 2, 5, 0.2).table)


def test_entropy_closed_form_two_state_chain() -> None:
    # P = [[1-a, a], [b, 1-b]]: pi = (b, a) / (a + b), H = pi0 h(a) + pi1 h(b).
    a, b = 0.2, 0.7
    src = MarkovSource.from_table([[1 - a, a], [b, 1 - b]], order=1)
    np.testing.assert_allclose(src.stationary(), [b / (a + b), a / (a + b)], rtol=1e-12)
    expected = (b * _binary_entropy(a) + a * _binary_entropy(b)) / (a + b)
    assert src.entropy_rate() == pytest.approx(expected, rel=1e-12)


def test_entropy_closed_form_on_drawn_table() -> None:
    src = MarkovSource(vocab_size=2, order=1, seed=11, concentration=0.7)
    a, b = src.table[0, 1], src.table[1, 0]
    expected = (b * _binary_entropy(a) + a * _binary_entropy(b)) / (a + b)
    assert src.entropy_rate() == pytest.approx(expected, rel=1e-12)


def test_entropy_closed_form_periodic_and_iid() -> None:
    flip = MarkovSource.from_table([[0.0, 1.0], [1.0, 0.0]], order=1)
    np.testing.assert_allclose(flip.stationary(), [0.5, 0.5])
    assert flip.entropy_rate() == 0.0
    # An order-2 table whose rows are all p is i.i.d.: pi = p (x) p and H = H(p).
    p = np.array([0.5, 0.3, 0.2])
    iid = MarkovSource.from_table(np.tile(p, (9, 1)), order=2)
    np.testing.assert_allclose(iid.stationary(), np.outer(p, p).ravel(), atol=1e-12)
    assert iid.entropy_rate() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)


def test_dense_solve_and_power_iteration_agree() -> None:
    src = MarkovSource(vocab_size=4, order=3, seed=2, concentration=0.2)
    dense = data._stationary_dense(src.table)
    power = data._stationary_power(src.table)
    np.testing.assert_allclose(dense, power, atol=1e-12)
    # Periodic chains converge too, thanks to the lazy step.
    flip = np.array([[0.0, 1.0], [1.0, 0.0]])
    np.testing.assert_allclose(data._stationary_power(flip), [0.5, 0.5], atol=1e-12)


def test_power_iteration_used_above_dense_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = MarkovSource(4, 2, seed=1, concentration=0.5).entropy_rate()
    monkeypatch.setattr(data, "_DENSE_SOLVE_MAX_STATES", 1)
    assert MarkovSource(4, 2, seed=1, concentration=0.5).entropy_rate() == pytest.approx(
        exact, abs=1e-12
    )


def test_entropy_rate_matches_empirical_estimate() -> None:
    src = MarkovSource(vocab_size=4, order=2, seed=0, concentration=0.5)
    seqs = src.batch(0, batch_size=256, seq_len=400, seed=0).astype(np.int64)
    ctx = seqs[:, :-2] * 4 + seqs[:, 1:-1]
    nll = -np.log(src.table[ctx, seqs[:, 2:]])
    # ~100k correlated tokens: the mean NLL is within a few hundredths of a nat.
    assert nll.mean() == pytest.approx(src.entropy_rate(), abs=0.03)
    assert 0.3 < src.entropy_rate() < np.log(4)


def test_samples_start_stationary_and_follow_the_table() -> None:
    src = MarkovSource(vocab_size=3, order=2, seed=1, concentration=1.0)
    seqs = src.batch(0, batch_size=20000, seq_len=2, seed=9).astype(np.int64)
    first_ctx = seqs[:, 0] * 3 + seqs[:, 1]
    freq = np.bincount(first_ctx, minlength=9) / len(first_ctx)
    np.testing.assert_allclose(freq, src.stationary(), atol=0.015)
    # Conditional frequencies of the third token given the first context.
    for s in np.argsort(src.stationary())[-3:]:
        rows = seqs[first_ctx == s, 2]
        emp = np.bincount(rows, minlength=3) / len(rows)
        np.testing.assert_allclose(emp, src.table[s], atol=0.04)


def test_short_rows_shorter_than_order() -> None:
    src = MarkovSource(vocab_size=4, order=3, seed=0, concentration=1.0)
    assert src.batch(0, 3, 1, seed=0).shape == (3, 2)


def test_lower_concentration_lowers_entropy() -> None:
    rates = [MarkovSource(16, 1, seed=0, concentration=c).entropy_rate() for c in (0.05, 1, 50)]
    assert rates[0] < rates[1] < rates[2] < np.log(16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 1}, r"^vocab_size must be >= 2, got 1$"),
        ({"vocab_size": "8"}, r"^vocab_size must be an integer, got '8'$"),
        ({"order": 0}, r"^order must be >= 1, got 0$"),
        ({"seed": -3}, r"^seed must be >= 0, got -3$"),
        ({"concentration": 0.0}, r"^concentration must be finite and > 0, got 0\.0$"),
        ({"concentration": float("nan")}, r"^concentration must be finite and > 0, got nan$"),
        ({"concentration": float("inf")}, r"^concentration must be finite and > 0, got inf$"),
        ({"concentration": "low"}, r"^concentration must be a number, got 'low'$"),
        (
            {"vocab_size": 2, "order": 21},
            r"2\*\*21 = 2097152 contexts exceeds the cap of 1048576",
        ),
        (
            {"vocab_size": 8192, "order": 1},
            r"= 67108864 table entries exceeds the cap of 16777216",
        ),
    ],
)
def test_markov_argument_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"vocab_size": 4, "order": 1, "seed": 0, "concentration": 1.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MarkovSource(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("table", "order", "match"),
    [
        ([0.5, 0.5], 1, r"table must have shape \[V\*\*order, V\] with V >= 2, got \(2,\)"),
        ([[1.0], [1.0]], 1, r"table must have shape .* got \(2, 1\)"),
        ([[0.5, 0.5]], 1, r"table has 1 rows, expected vocab\*\*order = 2\*\*1 = 2"),
        ([[1.5, -0.5], [0.5, 0.5]], 1, r"table entries must be finite and >= 0"),
        ([[0.5, np.nan], [0.5, 0.5]], 1, r"table entries must be finite and >= 0"),
        ([[0.5, 0.6], [0.5, 0.5]], 1, r"table rows must each sum to 1"),
        ([[0.5, 0.5], [0.5, 0.5]], 0, r"^order must be >= 1, got 0$"),
    ],
)
def test_from_table_errors(table: object, order: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MarkovSource.from_table(table, order)  # type: ignore[arg-type]


def test_reducible_table_has_no_stationary() -> None:
    src = MarkovSource.from_table([[1.0, 0.0], [0.0, 1.0]], order=1)
    with pytest.raises(
        ValueError, match=r"no unique stationary distribution \(chain is reducible\)"
    ):
        src.stationary()


def test_power_iteration_not_converging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_POWER_MAX_ITERS", 2)
    table = MarkovSource(4, 2, seed=0, concentration=0.5).table
    with pytest.raises(RuntimeError, match=r"did not converge in 2 iterations \(16 contexts"):
        data._stationary_power(table)


# ------------------------------------------------------------------------------ files


def test_file_windows_respect_the_split(token_path: Path) -> None:
    ds = TokenFile(token_path, vocab_size=1000)
    train = ds.batch(0, 256, 20, seed=0)
    evals = ds.batch(0, 256, 20, seed=0, split="eval")
    # Windows are contiguous runs of the file (token == position here).
    assert (np.diff(train, axis=1) == 1).all() and (np.diff(evals, axis=1) == 1).all()
    assert train.max() < 900 and evals.min() >= 900
    assert ds.entropy_rate() is None and len(ds) == 1000


def test_text_bytes_are_the_file_bytes(text_path: Path) -> None:
    ds = TextBytes(text_path)
    raw = np.frombuffer(text_path.read_bytes(), dtype=np.uint8)
    for row in ds.batch(0, 4, 10, seed=1):
        start = int(np.flatnonzero(raw == row[0])[0])  # each byte appears every 256
        np.testing.assert_array_equal(row, raw[start : start + 11])
    assert ds.vocab_size == 256 and ds.entropy_rate() is None


def test_file_too_short_for_seq_len(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    np.arange(20, dtype="<u2").tofile(path)  # train: 18 tokens, eval: 2
    ds = TokenFile(path, vocab_size=20)
    assert ds.batch(0, 2, 17, seed=0).shape == (2, 18)
    with pytest.raises(ValueError, match=r"short\.bin.*eval split"):
        ds.batch(0, 2, 2, seed=0, split="eval")
    with pytest.raises(ValueError, match=r"short\.bin.*train split"):
        ds.batch(0, 2, 18, seed=0)
    with pytest.raises(ValueError, match=r"short\.bin.*the eval split \(the last 10% of its"):
        ds.check_seq_len(2)
    ds.check_seq_len(1)
    MarkovSource(4, 1, seed=0, concentration=1.0).check_seq_len(1000)
    with pytest.raises(ValueError, match=r"^seq_len must be >= 1, got 0$"):
        MarkovSource(4, 1, seed=0, concentration=1.0).check_seq_len(0)
    with pytest.raises(ValueError, match=r"^seq_len must be >= 1, got 0$"):
        ds.check_seq_len(0)


def test_file_errors(tmp_path: Path, token_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match=r"nope\.bin' does not exist or is not a file"):
        TokenFile(missing, vocab_size=10)
    with pytest.raises(FileNotFoundError, match=r"nope\.bin' does not exist or is not a file"):
        TextBytes(missing)
    with pytest.raises(FileNotFoundError, match="does not exist or is not a file"):
        TextBytes(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt' is empty$"):
        TextBytes(empty)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"odd\.bin.*multiple of 2"):
        TokenFile(odd, vocab_size=10)
    with pytest.raises(ValueError, match=r"tokens\.bin.*token 999.*vocab_size=999"):
        TokenFile(token_path, vocab_size=999)
    with pytest.raises(ValueError, match=r"<= 65536 for uint16 tokens, got 65537; a raw file"):
        TokenFile(token_path, vocab_size=2**16 + 1)
    with pytest.raises(ValueError, match=r"^vocab_size must be >= 1, got 0$"):
        TokenFile(token_path, vocab_size=0)


# ---------------------------------------------------------------------------- factory


def test_make_dataset(token_path: Path, text_path: Path) -> None:
    common = {"vocab_size": 1000, "order": 2, "seed": 0, "concentration": 0.1}
    assert isinstance(make_dataset("text", path=str(text_path), **common), TextBytes)
    assert isinstance(make_dataset("tokens", path=str(token_path), **common), TokenFile)
    src = make_dataset("markov", path=None, vocab_size=32, order=2, seed=0, concentration=0.1)
    assert isinstance(src, MarkovSource) and src.vocab_size == 32
    assert src.entropy_rate() == MarkovSource(32, 2, 0, 0.1).entropy_rate()


def test_make_dataset_errors(text_path: Path) -> None:
    common = {"vocab_size": 256, "order": 1, "seed": 0, "concentration": 0.1}
    with pytest.raises(ValueError, match=r"data\.kind='bytes'.*'markov', 'text', 'tokens'"):
        make_dataset("bytes", path=None, **common)
    for kind in ("text", "tokens"):
        for path in (None, ""):
            with pytest.raises(ValueError, match=rf"^data\.path is required for .*'{kind}'"):
                make_dataset(kind, path=path, **common)
    with pytest.raises(ValueError, match=r"vocab_size=32 is too small for byte-level text"):
        make_dataset("text", path=str(text_path), **{**common, "vocab_size": 32})
    with pytest.raises(ValueError, match=r"^concentration must be finite and > 0, got -1\.0$"):
        make_dataset("markov", path=None, **{**common, "concentration": -1.0})


def test_docstring_examples() -> None:
    result = doctest.testmod(data, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0
