"""``meshkit.distributed``, kept as an entry point: the code is :mod:`meshkit.runtime.distributed`.
"""

from meshkit.runtime import distributed as _runtime
from meshkit.runtime.distributed import *  # noqa: F403  (the entry point re-exports it all)

__all__ = _runtime.__all__
