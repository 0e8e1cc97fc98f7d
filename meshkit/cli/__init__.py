"""Layer 9, cli: the ``meshkit`` command. The only layer that prints."""

from meshkit.cli.main import main

__all__ = ["main"]
