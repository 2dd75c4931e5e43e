"""The compiled path: static KV caches and ``torch.compile`` for the draft and verify steps.

``FlashSpecConfig(compile=...)`` (``--compile auto|on|off``) decides, once per engine, whether
the rounds run compiled (``policy.resolve_compile``, with one log line saying which and why).

On the compiled path each model keeps its keys and values in preallocated buffers
(``static``): a crop moves the write position and copies nothing, and the buffers' shapes stay
the same from round to round, so the few forward shapes a round uses (the drafter's one-token
step, the target's (gamma + 1)-token verification) are each compiled once and replayed
(``step``: inductor on CPU, CUDA graphs on CUDA). Prefill and other long forwards run eager on
the same buffers. The attention mask is built from the cache's ``RowLayout`` columns, so the
exactness argument of the eager path (``flashspec.kv.layout``) carries over unchanged: the
compiled step computes the same function as the eager one, only fused.
"""

from .policy import CompileDecision, CompileSetting, resolve_compile
from .step import CompiledForward

__all__ = ["CompileDecision", "CompileSetting", "CompiledForward", "resolve_compile"]
