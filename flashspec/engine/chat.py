"""Conversations to prompts: the tokenizer's chat template, or a plain transcript without one.

Used by ``SpeculativeEngine.chat``, ``flashspec generate --chat`` and the server's
``/v1/chat/completions``, so all three send a model the same tokens for the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Without a chat template the model would go on to write the user's next turn; this stop
# string ends the reply there.
FALLBACK_CHAT_STOP = "\nuser:"

Messages = str | Sequence[Mapping[str, Any]]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template refused the conversation."""


@dataclass(frozen=True)
class ChatText:
    """A conversation rendered for the model.

    Attributes:
        text: the prompt text, ending where the assistant's reply starts.
        special: whether tokenizing should add the tokenizer's special tokens (the fallback
            transcript); a chat template writes its own.
        stops: stop strings the format needs (the fallback's next-turn marker).
    """

    text: str
    special: bool
    stops: tuple[str, ...]


def conversation(messages: Messages, system: str | None = None) -> list[dict[str, Any]]:
    """``messages`` checked and copied: a string is one user turn; ``system`` goes first.

    Raises:
        TypeError / ValueError: naming the message and what is expected.
    """
    if isinstance(messages, str):
        turns: list[dict[str, Any]] = [{"role": "user", "content": messages}]
    elif isinstance(messages, Sequence):
        turns = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(
                    f"messages[{i}] must be a dict with 'role' and 'content', "
                    f"got {type(message).__name__}"
                )
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise ValueError(f"messages[{i}]['role'] must be a non-empty string")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}]['content'] must be a string")
            turns.append(dict(message))
    else:
        raise TypeError(
            "messages must be a string or a list of {'role', 'content'} dicts, "
            f"got {type(messages).__name__}"
        )
    if system is not None:
        if not isinstance(system, str):
            raise TypeError(f"system must be a string, got {type(system).__name__}")
        turns.insert(0, {"role": "system", "content": system})
    if not turns:
        raise ValueError("messages is empty; pass at least one message")
    return turns


def render(tokenizer: Any, turns: Sequence[Mapping[str, Any]]) -> ChatText:
    """The prompt text for ``turns`` (already checked, see ``conversation``).

    Raises:
        ChatTemplateError: the template raised (e.g. it does not allow a system message).
    """
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                list(turns), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise ChatTemplateError(f"the model's chat template refused them: {exc}") from None
        return ChatText(str(text), special=False, stops=())
    lines = [f"{turn['role']}: {turn['content']}" for turn in turns]
    return ChatText("\n".join([*lines, "assistant:"]), special=True, stops=(FALLBACK_CHAT_STOP,))


def chat_ids(
    tokenizer: Any, messages: Messages, system: str | None = None
) -> tuple[list[int], tuple[str, ...]]:
    """``(token ids, stop strings)`` of the prompt for ``messages``.

    Raises:
        TypeError / ValueError: bad messages; ChatTemplateError (a ValueError) when the
            template refuses them.
    """
    if tokenizer is None:
        raise ValueError("chat needs the target's tokenizer; pass tokenizer= to TargetModel")
    chat = render(tokenizer, conversation(messages, system))
    ids = tokenizer(chat.text, add_special_tokens=chat.special)["input_ids"]
    return [int(t) for t in ids], chat.stops


def chat_prompt(
    tokenizer: Any, messages: Messages, system: str | None, stop: str | Sequence[str] | None
) -> tuple[list[int], list[list[str] | None]]:
    """``engine.chat``'s one prompt row and its stop strings: the caller's, then the format's."""
    ids, format_stops = chat_ids(tokenizer, messages, system)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    return ids, [list(dict.fromkeys((*stops, *format_stops))) or None]
