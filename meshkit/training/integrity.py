"""File checksums of a checkpoint folder: recorded after a save, checked before a restore.

orbax stores array chunks zstd-compressed with no checksum (only the shard index carries
a CRC-32C), so bytes overwritten inside a chunk often decompress, without an error, into
wrong numbers: the restore "succeeds" and the run diverges later. Recording the size and
CRC-32 of every file when a checkpoint is written turns any overwritten, truncated or
missing file into a finding that names the file, before anything is read.

Several processes split the work: process ``i`` of ``n`` hashes every ``n``-th file of the
folder's sorted list from ``i`` and writes its own record
(``meshkit-checksums-<i>-of-<n>.json``), so no process reads the whole checkpoint;
checking is split the same way (with the processes of the restoring run, however many).
A folder without records (written before meshkit kept them, or by a run that died between
the save and the record) is unchecked here; orbax's own read errors still catch much.

JAX-free; :mod:`meshkit.training.checkpoint` uses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

__all__ = ["RECORD_PREFIX", "FileSum", "check_file", "first_damaged", "read_checksums",
           "record_checksums"]

RECORD_PREFIX = "meshkit-checksums"
"""Records (and their temporary files) start with this; they are not themselves hashed."""
_BLOCK = 8 << 20


@dataclasses.dataclass(frozen=True)
class FileSum:
    """One file's size and CRC-32 as recorded.

    Attributes:
        path: relative to the checkpoint folder, ``/``-separated.
        size: bytes.
        crc32: ``zlib.crc32`` of the contents.
    """

    path: str
    size: int
    crc32: int


def _files(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if not name.startswith(RECORD_PREFIX):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(p.replace(os.sep, "/") for p in found)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def record_checksums(folder: str, *, part: int = 0, parts: int = 1) -> str:
    """Hash this process's share of ``folder``'s files and write the record.

    Call it on every process once the checkpoint is complete (no file changes after).

    Args:
        folder: a finished checkpoint folder.
        part: this process's index.
        parts: the number of processes sharing the work.

    Returns:
        The record's path.

    Raises:
        ValueError: ``part`` not in ``0..parts-1``.

    Examples:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "a"), "wb").write(b"hello")
        >>> os.path.basename(record_checksums(folder))
        'meshkit-checksums-0-of-1.json'
        >>> read_checksums(folder)
        [FileSum(path='a', size=5, crc32=907060870)]
    """
    if not 0 <= part < parts:
        raise ValueError(f"part {part} out of range 0..{parts - 1}")
    sums = {p: [os.path.getsize(os.path.join(folder, p)), _crc32(os.path.join(folder, p))]
            for p in _files(folder)[part::parts]}
    path = os.path.join(folder, f"{RECORD_PREFIX}-{part}-of-{parts}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"files": sums}, f)
    os.replace(tmp, path)  # a reader never sees half a record
    return path


def read_checksums(folder: str) -> list[FileSum]:
    """Every file the folder's records list, sorted by path (empty: no records).

    Args:
        folder: a checkpoint folder.

    Returns:
        The recorded sums.

    Raises:
        ValueError: a record that cannot be read or parsed (the message names it).

    Examples:
        >>> import tempfile
        >>> read_checksums(tempfile.mkdtemp())
        []
    """
    sums: dict[str, FileSum] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise ValueError(f"cannot list {folder} ({e.strerror})") from None
    for name in names:
        if not (name.startswith(RECORD_PREFIX) and name.endswith(".json")):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                files = json.load(f)["files"]
            for p, (size, crc) in files.items():
                sums[p] = FileSum(p, int(size), int(crc))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                ValueError) as e:
            raise ValueError(f"checksum record {name} is unreadable ({e})") from None
    return [sums[p] for p in sorted(sums)]


def check_file(folder: str, entry: FileSum) -> str | None:
    """What is wrong with one recorded file, or ``None`` if it is as recorded.

    Args:
        folder: the checkpoint folder.
        entry: the file's record.

    Returns:
        ``None``, or a reason naming the file: missing, truncated, grown, or changed.

    Examples:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> check_file(folder, FileSum("d/x", 4, 0))
        'd/x is missing'
    """
    path = os.path.join(folder, entry.path)
    try:
        size = os.path.getsize(path)
        if size < entry.size:
            return f"{entry.path} is truncated ({size} of {entry.size} bytes)"
        if size > entry.size:
            return f"{entry.path} has grown ({size} bytes, {entry.size} recorded)"
        if _crc32(path) != entry.crc32:
            return f"{entry.path} has changed: its CRC-32 differs from the recorded one"
    except FileNotFoundError:
        return f"{entry.path} is missing"
    except OSError as e:
        return f"{entry.path} cannot be read ({e.strerror})"
    return None


def first_damaged(
    folder: str, entries: list[FileSum], *, part: int = 0, parts: int = 1
) -> int | None:
    """The index in ``entries`` of the first damaged file of this process's share.

    Args:
        folder: the checkpoint folder.
        entries: :func:`read_checksums` of it (the same list on every process).
        part: this process's index.
        parts: the number of processes sharing the work.

    Returns:
        An index into ``entries``, or ``None`` when this share is intact.

    Examples:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> first_damaged(folder, [FileSum("a", 1, 0), FileSum("b", 1, 0)], part=1, parts=2)
        1
    """
    for i in range(part, len(entries), parts):
        if check_file(folder, entries[i]) is not None:
            return i
    return None
