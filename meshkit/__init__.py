"""meshkit: parallel strategies as JAX meshes, a two-stage all-to-all, and MoE training."""

from meshkit.strategy import Strategy

__all__ = ["Strategy"]
