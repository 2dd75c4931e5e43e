"""The chat requests of ``flashspec bench engine`` on a real model: HumanEval functions to
complete, and copy-heavy requests built from HumanEval's solutions (rename a function, add a
docstring, add type hints) and from texts written for this benchmark (restate or quote one).
"""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import dataclass
from typing import Any

from ..engine import chat as engine_chat
from .common import HUMANEVAL

COPY_KINDS = ("rename", "docstring", "type_hints", "text")


@dataclass(frozen=True)
class ChatRequest:
    """One user message: ``workload`` is ``humaneval`` or ``copy``; ``kind`` what it asks."""

    id: str
    workload: str
    kind: str
    user: str


def _humaneval_tasks() -> list[dict[str, Any]]:
    with gzip.open(HUMANEVAL, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def humaneval_requests(limit: int) -> list[ChatRequest]:
    """The first ``limit`` HumanEval prompts, each asked as a chat request to complete it."""
    return [
        ChatRequest(
            task["task_id"],
            "humaneval",
            "complete",
            f"Complete this Python function:\n```python\n{task['prompt']}```",
        )
        for task in _humaneval_tasks()[:limit]
    ]


# Texts written for this benchmark (no source): each paragraph is plain, concrete and made up.
TEXTS: tuple[tuple[str, str], ...] = (
    (
        "The village of Lower Brackwell sits where two slow rivers meet. Its water mill was "
        "built in 1822 and still grinds flour every Saturday morning. A stone footbridge links "
        "the bakery to the church, and the bakery opens at six o'clock each day. Most visitors "
        "arrive on the small train that stops at the village twice an hour.",
        "When does the bakery open?",
    ),
    (
        "On Monday the team tested the new water pump at three speeds. At the lowest speed it "
        "moved four litres a minute and stayed quiet. At the middle speed the flow doubled, "
        "but a faint whistle could be heard. At the highest speed the seal began to leak after "
        "ten minutes, so the test was stopped early.",
        "Why was the test stopped early?",
    ),
    (
        "To make the sauce, warm two spoons of olive oil in a wide pan. Add one chopped onion "
        "and cook it gently until it turns soft and golden. Stir in a tin of tomatoes, a pinch "
        "of salt and a few basil leaves. Let the sauce simmer for twenty minutes, then taste "
        "it and add pepper if it needs it.",
        "How long should the sauce simmer?",
    ),
    (
        "The town library will close early on Friday because its heating system is being "
        "replaced. Books that are due that day can be returned on Saturday without a fine. The "
        "reading room on the second floor stays open until noon. The new heating should make "
        "the building warmer and cheaper to run next winter.",
        "Can books due on Friday be returned later?",
    ),
)


# Without it the 135M model often answers with prose about the code instead of the code.
CODE_ONLY = "Reply with the code only."


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest) if rest else f"my_{name}"


def _strip(source: str, *, docstrings: bool, annotations: bool) -> str:
    """``source`` without the functions' docstrings and/or type annotations (via ``ast``)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        if annotations:
            node.returns = None
            for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                arg.annotation = None
            for extra in (node.args.vararg, node.args.kwarg):
                if extra is not None:
                    extra.annotation = None
        first = node.body[0] if node.body else None
        if (
            docstrings
            and isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            node.body = node.body[1:] or [ast.Pass()]
    if annotations:  # the typing imports would be unused
        tree.body = [
            n
            for n in tree.body
            if not (isinstance(n, ast.ImportFrom) and n.module == "typing")
            and not (isinstance(n, ast.Import) and n.names[0].name == "typing")
        ]
    return ast.unparse(tree)


def copy_prompts(n: int, max_chars: int = 900, first_task: int = 100) -> list[ChatRequest]:
    """``n`` copy-heavy chat requests, the kinds of ``COPY_KINDS`` in turn.

    The code comes from HumanEval (prompt + canonical solution) from task ``first_task`` on,
    skipping tasks longer than ``max_chars`` (the ``humaneval`` workload takes the first tasks):

    - ``rename``: rename the task's function (to its camelCase name) and return the whole code;
    - ``docstring``: the code without docstrings; add one and return the whole code;
    - ``type_hints``: the code without annotations; add type hints, return the whole code;
    - ``text``: a short paragraph of ``TEXTS``, alternately restated as a bulleted list with
      its sentences unchanged, or a question answered by quoting the text.
    """
    tasks = [
        t
        for t in _humaneval_tasks()[first_task:]
        if len(t["prompt"] + t["canonical_solution"]) <= max_chars
    ]
    out: list[ChatRequest] = []
    counters = dict.fromkeys(COPY_KINDS, 0)
    code_index = 0
    while len(out) < n:
        kind = COPY_KINDS[len(out) % len(COPY_KINDS)]
        i = counters[kind]
        counters[kind] += 1
        if kind == "text":
            text, question = TEXTS[(i // 2) % len(TEXTS)]
            if i % 2 == 0:
                user = (
                    "Rewrite the following text as a bulleted list with one sentence per "
                    f"bullet. Keep every sentence word for word. Reply with the list only."
                    f"\n\n{text}"
                )
            else:
                user = (
                    f"Read the text and answer the question. Quote the sentence of the text "
                    f"that answers it.\n\nText: {text}\n\nQuestion: {question}"
                )
            out.append(ChatRequest(f"text/{i}", "copy", kind, user))
            continue
        task = tasks[code_index % len(tasks)]
        code_index += 1
        source = task["prompt"] + task["canonical_solution"]
        name = task["entry_point"]
        if kind == "rename":
            user = (
                f"Rename the function `{name}` to `{_camel(name)}` in this code and return "
                f"the whole code. {CODE_ONLY}\n```python\n{source.strip()}\n```"
            )
        elif kind == "docstring":
            code = _strip(source, docstrings=True, annotations=False)
            user = (
                f"Add a docstring to this function and return the whole code. {CODE_ONLY}\n"
                f"```python\n{code}\n```"
            )
        else:
            code = _strip(source, docstrings=False, annotations=True)
            user = (
                f"Add type hints to this function and return the whole code. {CODE_ONLY}\n"
                f"```python\n{code}\n```"
            )
        out.append(ChatRequest(f"{kind}/{task['task_id']}", "copy", kind, user))
    return out


def chat_ids(tokenizer: Any, request: ChatRequest) -> list[int]:
    """The request's token ids as ``engine.chat`` and ``generate --chat`` make them."""
    ids, _ = engine_chat.chat_ids(tokenizer, request.user)
    return ids
