"""The flags that build an engine, shared by every command that builds one: ``flashspec
generate`` and ``serve`` (``flashspec.cli``), the benchmarks (``flashspec.bench``) and the
cluster's replicas (``flashspec.cluster``). ``options``: ``EngineOptions`` and what every command
shares (``UserError``, ``first_line``, ``quiet_libraries``); ``argtypes``: argparse value types.

A package of its own, not part of ``flashspec.cli``: the command line imports the benchmarks'
subcommands, which import these flags, so inside ``cli`` they would close an import cycle.
"""
