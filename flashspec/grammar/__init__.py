"""Structured output: a grammar (JSON schema, any JSON object, a regular expression or a Lark
grammar) that every generated token must keep valid, enforced exactly under speculation.

The grammar engine is llguidance (``pip install 'flashspec[grammar]'``): a Rust matcher with no
Python dependencies whose state rolls back token by token, which is what a round needs to mask
the target's logits after each draft and drop the rejected ones. Modules: ``spec`` (what the
user gives, checked and bounded), ``tokens`` (the tokenizer as the matcher sees it), ``masks``
(the per-row matchers and the per-round masks).
"""

from __future__ import annotations

from .spec import Grammar, GrammarError

__all__ = ["Grammar", "GrammarError"]
