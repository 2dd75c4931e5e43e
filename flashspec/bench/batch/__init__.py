"""``flashspec bench batch``: ragged and lockstep batches against HF batched ``generate``
(``batch.json``). ``methods`` is what it times, ``measure`` the run, ``report`` the table,
``command`` the flags and ``main``.

The names of the earlier module ``flashspec.bench.batch`` resolve through ``flashspec.legacy``.
"""

from ...legacy import earlier_module

__getattr__, __dir__, __all__ = earlier_module(globals())
