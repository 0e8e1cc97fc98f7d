"""meshkit's benchmarks, shipped with the package: ``meshkit bench NAME [ARGS]``.

Each benchmark is a module ``meshkit.benchmarks.bench_NAME`` (the names:
:data:`meshkit.choices.BENCHMARKS`) that ``meshkit bench NAME`` runs in a process of its
own, as ``python -m meshkit.benchmarks.bench_NAME ARGS``: most set the simulated CPU
device count before JAX starts. Each prints its tables and, with ``--json FILE``
(``-``: stdout), writes them as one JSON report of the same form for all of them
(:mod:`meshkit.benchmarks._report`: the commit, the machine, the tables, the targets).

The benchmarks are the top layer: they import anything of meshkit's, nothing imports
them (``tests/test_layers.py``). Importing this package imports nothing.
"""
