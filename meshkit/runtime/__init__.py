"""Layer 1, runtime: processes. Start-up over ``jax.distributed``, local launch, agreement.

- :mod:`~meshkit.runtime.distributed`: ``initialize()`` and the simulated CPU device count.
- :mod:`~meshkit.runtime.launch`: ``meshkit launch``, N local processes of one command.
- :mod:`~meshkit.runtime.agree`: the elementwise maximum of a few integers over processes.
"""
