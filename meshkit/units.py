"""Numbers for people: the one place that writes a byte count in binary units."""

from __future__ import annotations

__all__ = ["format_bytes"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(value: float, *, digits: int | None = None) -> str:
    """A byte count in the largest binary unit below it.

    Args:
        value: bytes, >= 0 (an exact ``int`` of any size, or a float).
        digits: significant digits (``"1.5 MiB"``, ``"256 KiB"``), for axis ticks; default
            one decimal place, and whole bytes below 1 KiB.

    Returns:
        The text; a power of two for counts past 2^70 (what a float cannot divide well).

    Examples:
        >>> format_bytes(1536), format_bytes(2**20, digits=3), format_bytes(100)
        ('1.5 KiB', '1 MiB', '100 B')
    """
    if isinstance(value, int) and value.bit_length() > 70:
        return f"about 2^{value.bit_length() - 1} bytes"
    size = float(value)
    for unit in _UNITS:
        if size < 1024 or unit == _UNITS[-1]:
            break
        size /= 1024
    if digits is not None:
        return f"{size:.{digits}g} {unit}"
    return f"{value} B" if unit == "B" else f"{size:.1f} {unit}"
