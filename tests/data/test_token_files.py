"""Token files as users have them: ``.npy`` arrays of any integer dtype, raw files of a dtype.

Every file is tiny and made in ``tmp_path``; the values tell where a window came from.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from meshkit import choices
from meshkit.config import Config, ConfigError
from meshkit.data import sources
from meshkit.data.sources import RAW_DTYPE, TokenFile, make_dataset
from meshkit.training.loop import config_dataset


def _windows_are_slices(ds: TokenFile, tokens: np.ndarray) -> None:
    """Every row of a few batches is a contiguous run of ``tokens`` (token == position)."""
    for split in ("train", "eval"):
        batch = ds.batch(0, 16, 8, seed=0, split=split)
        assert batch.dtype == np.int32
        for row in batch:
            start = int(np.flatnonzero(tokens == row[0])[0])
            np.testing.assert_array_equal(row, tokens[start : start + 9])


@pytest.mark.parametrize(
    ("dtype", "first"),
    [
        ("uint16", 0),
        ("int32", 0),
        ("uint32", 65_530),  # ids above uint16's range, for a vocabulary above 65,536
        ("int64", 2**31 - 200),
        (">i4", 100),  # a big-endian header: numpy reads it, the values are the same
    ],
)
def test_npy_of_any_integer_dtype(tmp_path: Path, dtype: str, first: int) -> None:
    tokens = np.arange(first, first + 200).astype(dtype)
    path = tmp_path / "t.npy"
    np.save(path, tokens)
    vocab = first + 200
    ds = TokenFile(path, vocab_size=vocab)
    assert len(ds) == 200 and ds.dtype == np.dtype(dtype) and ds.vocab_size == vocab
    assert isinstance(ds._tokens, np.memmap)  # mapped, never read whole
    _windows_are_slices(ds, tokens)
    assert TokenFile(path, vocab_size=vocab, dtype=np.dtype(dtype).name).dtype == ds.dtype


def test_uint32_npy_above_65536(tmp_path: Path) -> None:
    tokens = np.array([70_000, 0, 65_536, 65_535, 99_999] * 10, dtype=np.uint32)
    np.save(tmp_path / "big.npy", tokens)
    ds = TokenFile(tmp_path / "big.npy", vocab_size=100_000)
    rows = ds.batch(0, 4, 3, seed=0)
    assert rows.max() > 65_535 and set(rows.ravel()) <= set(tokens.tolist())


@pytest.mark.parametrize("name", ["t.npy", "saved_as.bin"])
def test_a_npy_header_is_never_read_as_tokens(tmp_path: Path, name: str) -> None:
    # int32 read as raw uint16 was the reported bug: header bytes as tokens, then every
    # other token 0. The first tokens here are known; they must come out exactly.
    tokens = np.array([7, 3, 9, 1, 5, 8, 2, 6, 4, 0] * 2, dtype=np.int32)
    path = tmp_path / name
    with open(path, "wb") as f:  # np.save would append .npy to the .bin name
        np.save(f, tokens)
    ds = TokenFile(path, vocab_size=10)
    assert len(ds) == tokens.size == 20
    # 20 tokens: train is the first 18, eval the last 2, so these windows are the whole split.
    np.testing.assert_array_equal(ds.batch(0, 3, 17, seed=0), np.tile(tokens[:18], (3, 1)))
    np.testing.assert_array_equal(ds.batch(0, 2, 1, seed=0, split="eval"),
                                  np.tile(tokens[18:], (2, 1)))
    assert ds.dtype == np.int32


def test_bin_with_a_dtype(tmp_path: Path) -> None:
    tokens = np.arange(65_500, 65_700, dtype="<u4")
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    ds = TokenFile(path, vocab_size=70_000, dtype="uint32")
    assert len(ds) == 200 and ds.dtype == np.dtype("<u4")
    assert isinstance(ds._tokens, np.memmap)
    _windows_are_slices(ds, tokens)
    # Without its dtype the file would be read as uint16 halves, all below 65,536: the
    # vocabulary is what gives the misread away.
    with pytest.raises(ValueError, match=r"^vocab_size must be <= 65536 for uint16 tokens, "
                       r"got 70000; a raw file of wider ids needs its dtype"):
        TokenFile(path, vocab_size=70_000)
    made = make_dataset("tokens", path=path, vocab_size=70_000, order=1, seed=0,
                        concentration=1.0, dtype="uint32")
    assert isinstance(made, TokenFile) and made.dtype == np.dtype("<u4")


def test_raw_files_default_to_uint16(tmp_path: Path) -> None:
    assert RAW_DTYPE == "uint16" and RAW_DTYPE in choices.TOKEN_DTYPES
    np.arange(50, dtype="<u2").tofile(tmp_path / "t.bin")
    assert TokenFile(tmp_path / "t.bin", vocab_size=50).dtype == np.dtype("<u2")
    np.arange(50, dtype="<i4").tofile(tmp_path / "i.bin")
    assert TokenFile(tmp_path / "i.bin", vocab_size=50, dtype="int32").dtype == np.int32


def test_every_accepted_dtype_reads_a_raw_file(tmp_path: Path) -> None:
    for dtype in choices.TOKEN_DTYPES:
        tokens = np.arange(100, dtype=np.dtype(dtype).newbyteorder("<"))
        tokens.tofile(tmp_path / f"{dtype}.bin")
        ds = TokenFile(tmp_path / f"{dtype}.bin", vocab_size=100, dtype=dtype)
        _windows_are_slices(ds, tokens)


# ----------------------------------------------------------------------------- errors


def test_an_unknown_dtype_is_named(tmp_path: Path) -> None:
    np.arange(10, dtype="<u2").tofile(tmp_path / "t.bin")
    for bad in ("float32", "u2", "<u4"):
        with pytest.raises(ValueError, match=rf"^dtype={re.escape(repr(bad))} is not one of "
                           r"uint16, uint32, int32"):
            TokenFile(tmp_path / "t.bin", vocab_size=10, dtype=bad)


@pytest.mark.parametrize(
    ("array", "described"),
    [
        (np.zeros(4, dtype=np.float32), "dtype float32 and shape (4,)"),
        (np.zeros(4, dtype=np.bool_), "dtype bool and shape (4,)"),
        (np.zeros((2, 3), dtype=np.int32), "dtype int32 and shape (2, 3)"),
        (np.int32(5), "dtype int32 and shape ()"),
    ],
)
def test_a_npy_that_is_not_1d_integers_is_named(tmp_path: Path, array: np.ndarray,
                                                described: str) -> None:
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(ValueError, match=rf"^data file '.*bad\.npy' holds an array of "
                       rf"{re.escape(described)}; token ids must be a 1-d array of integers$"):
        TokenFile(tmp_path / "bad.npy", vocab_size=10)


def test_a_dtype_that_disagrees_with_the_npy_header(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError, match=r"^data file '.*t\.npy' holds int32 tokens \(its \.npy "
                       r"header\), but dtype='uint16' was given; leave dtype unset or make it "
                       r"'int32'$"):
        TokenFile(tmp_path / "t.npy", vocab_size=10, dtype="uint16")


def test_a_raw_size_not_a_multiple_of_the_itemsize(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x00\x00\x02\x00")
    with pytest.raises(ValueError, match=r"^data file '.*t\.bin' has 6 bytes, not a multiple "
                       r"of 4 \(uint32 tokens\)$"):
        TokenFile(tmp_path / "t.bin", vocab_size=10, dtype="uint32")
    assert len(TokenFile(tmp_path / "t.bin", vocab_size=10)) == 3  # fine as uint16


def _write(path: Path, tokens: np.ndarray) -> None:
    if path.suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)


@pytest.mark.parametrize("name", ["t.npy", "t.bin"])
def test_a_token_out_of_the_vocabulary_is_named_with_its_position(tmp_path: Path,
                                                                  name: str) -> None:
    tokens = np.arange(100, dtype="<i4") % 10
    tokens[37], tokens[60] = 12, 99  # the first one is named
    _write(tmp_path / name, tokens)
    with pytest.raises(ValueError, match=rf"^data file '.*{re.escape(name)}' holds token 12 at "
                       r"position 37, not below vocab_size=10$"):
        TokenFile(tmp_path / name, vocab_size=10, dtype="int32")


@pytest.mark.parametrize("name", ["t.npy", "t.bin"])
def test_a_negative_token_is_named_with_its_position(tmp_path: Path, name: str) -> None:
    tokens = np.arange(100, dtype="<i2") % 10
    tokens[81] = -3
    _write(tmp_path / name, tokens)
    with pytest.raises(ValueError, match=rf"^data file '.*{re.escape(name)}' holds token -3 at "
                       r"position 81; token ids must be >= 0$"):
        TokenFile(tmp_path / name, vocab_size=10, dtype="int16")


def test_the_range_check_runs_in_chunks(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # With 7 tokens a chunk, a bad token in a later chunk is found at its file position.
    monkeypatch.setattr(sources, "_SCAN_CHUNK", 7)
    tokens = np.arange(100, dtype=np.uint32) % 50
    np.save(tmp_path / "t.npy", tokens)
    assert len(TokenFile(tmp_path / "t.npy", vocab_size=50)) == 100
    tokens[93] = 50
    np.save(tmp_path / "t.npy", tokens)
    with pytest.raises(ValueError, match=r"holds token 50 at position 93, not below "):
        TokenFile(tmp_path / "t.npy", vocab_size=50)
    seen: list[int] = []

    class Recording(np.ndarray):
        """Records how many tokens each read of the range check takes."""

        def __getitem__(self, key: slice) -> np.ndarray:  # type: ignore[override]
            out = np.asarray(super().__getitem__(key))
            seen.append(out.size)
            return out

    with pytest.raises(ValueError, match="position 93"):
        sources._check_token_range(tokens.view(Recording), "t.npy", 50)
    assert seen == [7] * 14  # never the whole file at once; 93 is in the 14th chunk


def test_a_dtype_too_narrow_to_go_wrong_skips_the_scan(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    np.arange(256, dtype=np.uint8).tofile(tmp_path / "t.bin")
    monkeypatch.setattr(sources, "_SCAN_CHUNK", 0)  # a scan would fail: range() step 0
    assert len(TokenFile(tmp_path / "t.bin", vocab_size=256, dtype="uint8")) == 256


def test_other_npy_trouble_is_named(tmp_path: Path) -> None:
    np.arange(10, dtype="<u2").tofile(tmp_path / "raw.npy")
    with pytest.raises(ValueError, match=r"raw\.npy' is named \.npy but has no \.npy header"):
        TokenFile(tmp_path / "raw.npy", vocab_size=10)
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.int32))
    with pytest.raises(ValueError, match=r"empty\.npy' is empty \(its \.npy array has no"):
        TokenFile(tmp_path / "empty.npy", vocab_size=10)
    np.save(tmp_path / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"objects\.npy' is not a readable \.npy file: "):
        TokenFile(tmp_path / "objects.npy", vocab_size=10)
    cut = (tmp_path / "cut.npy")
    np.save(cut, np.arange(10, dtype=np.int32))
    cut.write_bytes(cut.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"cut\.npy' is not a readable \.npy file: "):
        TokenFile(cut, vocab_size=10)


def test_vocab_size_bounds(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int64))
    with pytest.raises(ValueError, match=r"^vocab_size must be <= 2147483648 \(batches are "
                       r"int32\), got 2147483649$"):
        TokenFile(tmp_path / "t.npy", vocab_size=2**31 + 1)
    # A .npy's dtype is known, so a vocabulary wider than it is no sign of a misread.
    np.save(tmp_path / "u8.npy", np.arange(10, dtype=np.uint8))
    assert TokenFile(tmp_path / "u8.npy", vocab_size=1000).vocab_size == 1000


# ------------------------------------------------------------------ through the config


def _config(path: Path, vocab: int, *dtype: str) -> Config:
    data = {"kind": "tokens", "path": str(path), **({"dtype": dtype[0]} if dtype else {})}
    return Config().replace(data=data, model={"vocab_size": vocab}, train={"seq_len": 8})


def test_config_dataset_reads_npy_and_raw_files(tmp_path: Path) -> None:
    tokens = np.arange(65_500, 65_700, dtype=np.uint32)
    np.save(tmp_path / "t.npy", tokens)
    tokens.tofile(tmp_path / "t.bin")
    for config in (_config(tmp_path / "t.npy", 70_000),
                   _config(tmp_path / "t.npy", 70_000, "uint32"),
                   _config(tmp_path / "t.bin", 70_000, "uint32")):
        ds = config_dataset(config)
        assert isinstance(ds, TokenFile) and len(ds) == 200
        _windows_are_slices(ds, tokens)


@pytest.mark.parametrize(
    ("name", "vocab", "dtype", "message"),
    [
        ("t.npy", 65_600, (), r"t\.npy' holds token 65600 at position 100, not below "
         r"vocab_size=65600$"),
        ("t.npy", 70_000, ("int32",), r"t\.npy' holds uint32 tokens \(its \.npy header\), "
         r"but dtype='int32' was given"),
        ("t.bin", 70_000, (), r"^data: vocab_size must be <= 65536 for uint16 tokens, got 70000"),
        ("t.bin", 70_000, ("int64",), r"t\.bin' has 804 bytes, not a multiple of 8 "
         r"\(int64 tokens\)$"),
    ],
)
def test_config_dataset_reports_file_errors_as_config_errors(
    tmp_path: Path, name: str, vocab: int, dtype: tuple[str, ...], message: str
) -> None:
    # The config error train() raises before anything compiles; the message names the file.
    tokens = np.arange(65_500, 65_701, dtype=np.uint32)
    np.save(tmp_path / "t.npy", tokens)
    tokens.tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=message) as info:
        config_dataset(_config(tmp_path / name, vocab, *dtype))
    assert str(info.value).startswith("data: ")
