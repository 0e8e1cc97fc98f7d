"""Layer 1, data: token sources and the batches each process loads onto the mesh.

- :mod:`~meshkit.data.sources`: synthetic Markov source, byte text, token files.
- :mod:`~meshkit.data.batches`: a global batch, each process loading only its own rows.
"""
