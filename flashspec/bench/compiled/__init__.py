"""``flashspec bench compiled``: the compiled path against flashspec eager and HF ``generate``
(``compiled.json``). ``methods`` is what it times, ``measure`` the run, ``report`` the tables,
``command`` the flags and ``main``.

The names of the earlier module ``flashspec.bench.compiled`` resolve through ``flashspec.legacy``.
"""

from ...legacy import earlier_module

__getattr__, __dir__, __all__ = earlier_module(globals())
