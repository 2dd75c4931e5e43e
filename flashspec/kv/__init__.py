"""The KV cache: what a cache holds, and every operation on it that must stay exact.

- ``layout``: which cache columns hold which row's tokens (ragged batches), and the column
  operations on a cache's layers.
- ``cache``: ``RowCache``, a cache whose rows keep their own columns: a forward planned over
  ragged rows, then crop, compaction, rows added, selected and kept. The target, the model
  drafters (through ``CausalLM``) and the features draft share it.
- ``state``: recurrent and convolutional state (snapshots, the rollback gate
  ``check_support``), for the caches that cannot crop.
- ``mamba1``: Mamba-1 mixers whose scan starts from the cached state (the gate applies it;
  ``new_cache`` marks the caches it acts on).
- ``compat``: transformers releases' differences (the cache argument, ``Cache.crop``).

Nothing here imports the rest of flashspec: models and drafters build on it.
"""
