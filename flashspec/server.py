"""The earlier path of the HTTP server, kept for old imports: use ``flashspec.serve``.

Its names are listed in ``flashspec.legacy``; they need the ``[serve]`` extra, as they always
did.
"""

from .legacy import earlier_module

__getattr__, __dir__, __all__ = earlier_module(globals())
