"""``flashspec bench engine --target NAME``: flashspec on a real chat model. ``methods`` is what it
times, ``measure`` the run, ``command`` the flags and ``main``; its tables are
``flashspec.bench.report``'s.

The names of the earlier module ``flashspec.bench.chat`` resolve through ``flashspec.legacy``.
"""

from ...legacy import earlier_module

__getattr__, __dir__, __all__ = earlier_module(globals())
