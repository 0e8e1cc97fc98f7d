"""An exact emulation of ``jax.lax.ragged_all_to_all`` from public collectives, for tests.

XLA:CPU does not implement ``ragged-all-to-all``, so the CPU tests run
:mod:`meshkit.exchange.ragged` with this stand-in (through its test hook). It follows the
op's docstring (JAX 0.10.2) literally:

* slice ``i`` of the caller's ``operand`` (``input_offsets[i]``, ``send_sizes[i]``
  rows) goes to device ``i // (K / P)``;
* received slice ``i`` (from device ``i // (K / P)``) is written at
  ``all_to_all(output_offsets)[i]``, ``recv_sizes[i]`` rows long, into a copy of
  ``output``; every other row keeps ``output``'s value.

Each slice travels padded to the operand's full length (a plain tiled all-to-all of
``[K, rows, ...]``), so this moves far more bytes than the real op: it checks values
and gradients, never speed. Rows are selected, never summed, so values are exact.
Gathers rather than a loop of dynamic_update_slice: one traced op for all K slices
keeps compile time small. Gradients are autodiff through all_to_all, gather and where.
"""

import contextlib

import jax
import jax.numpy as jnp

from meshkit.exchange import ragged


@contextlib.contextmanager
def ragged_op(op):
    """Route eligible dropless exchanges through ``op`` while tracing inside this block."""
    old = ragged._test_ragged_all_to_all
    ragged._test_ragged_all_to_all = op
    try:
        yield
    finally:
        ragged._test_ragged_all_to_all = old


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    num = input_offsets.shape[0]
    for name, arr in (("send_sizes", send_sizes), ("output_offsets", output_offsets),
                      ("recv_sizes", recv_sizes)):
        if arr.shape != (num,):
            raise ValueError(f"{name} has shape {arr.shape}, input_offsets has ({num},)")
    if num % jax.lax.axis_size(axis_name):
        raise ValueError(f"{num} slices do not split over axis {axis_name!r}")
    rows, size = operand.shape[0], output.shape[0]
    tail = (1,) * (operand.ndim - 1)

    # SEND: slice i, zero-padded to the operand's length -> [K, rows, ...].
    within = jnp.arange(rows)[None, :]  # [1, rows]
    src = input_offsets[:, None] + within  # [K, rows]
    sent = within < send_sizes[:, None]
    pieces = jnp.where(sent.reshape(num, rows, *tail),
                       operand[jnp.where(sent, src, 0)], 0)
    got = jax.lax.all_to_all(pieces, axis_name, 0, 0, tiled=True)  # got[i]: from i // (K/P)

    # RECEIVE: row r of the result is row r - start[i] of received slice i if some slice
    # covers r, else output[r].
    start = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [K]
    r = jnp.arange(size)[None, :]  # [1, size]
    covers = (r >= start[:, None]) & (r < start[:, None] + recv_sizes[:, None])  # [K, size]
    which = jnp.argmax(covers, axis=0)  # the covering slice (slices do not overlap)
    offset = jnp.clip(r[0] - start[which], 0, rows - 1)
    return jnp.where(jnp.any(covers, axis=0).reshape(size, *tail),
                     got[which, offset], output)
