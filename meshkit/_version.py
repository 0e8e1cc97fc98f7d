"""The installed distribution's version: ``meshkit.__version__`` and ``meshkit --version``."""

import importlib.metadata

__all__ = ["__version__"]

try:
    __version__: str = importlib.metadata.version("meshkit")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
