"""The earlier path of ``flashspec.flags.options``, kept for old imports (``flashspec.legacy``)."""

from .legacy import earlier_module

__getattr__, __dir__, __all__ = earlier_module(globals())
