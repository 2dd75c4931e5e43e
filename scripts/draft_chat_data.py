"""Chat data for ``train_draft.py``: the target's own answers to instruction prompts made here.

Three kinds of prompt, none from a dataset and none from HumanEval:

- ``prompts()``: templates filled with topics written for this project (programming requests,
  explanations, everyday questions);
- ``self_instruct()``: requests the target writes itself, sampled from its chat template's
  opening up to the user's turn (the idea of Magpie, Xu et al. 2024), some started with a few
  words that steer them towards code; far more varied than the templates;
- ``completion_prompts()``: "complete this function" requests built from the signatures and
  docstrings of functions in the Python standard library's source.

The target answers each greedily under its chat template, in batches, and the token ids (prompt
and answer) are what the draft trains on. ``held_out(prompt)`` splits them by a hash of the
prompt.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import random
import sys
from typing import Any

import torch
from tqdm import tqdm

from flashspec.engine.chat import chat_ids

CODE_TASKS = (
    "reverses the words in a sentence",
    "counts the vowels in a string",
    "checks whether a number is prime",
    "merges two sorted lists",
    "flattens a nested list",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list while keeping the order",
    "parses a date in the form YYYY-MM-DD",
    "reads a CSV file and returns its rows as dictionaries",
    "computes the average of a list of numbers",
    "finds the longest word in a text",
    "converts Celsius to Fahrenheit",
    "checks whether a string is a palindrome",
    "groups a list of words by their first letter",
    "computes the factorial of a number",
    "returns the intersection of two lists",
    "sorts a list of dictionaries by a key",
    "validates an email address with a regular expression",
    "counts how often each word appears in a text",
    "splits a list into chunks of a given size",
    "finds the maximum value in a dictionary",
    "capitalises the first letter of every word",
    "computes the greatest common divisor of two numbers",
    "transposes a matrix given as a list of lists",
    "implements binary search on a sorted list",
    "writes a list of strings to a text file, one per line",
    "generates all permutations of a string",
    "checks whether two strings are anagrams",
    "converts a Roman numeral to an integer",
    "sums the digits of an integer",
)
TOPICS = (
    "Python decorators",
    "list comprehensions",
    "recursion",
    "hash tables",
    "the difference between a list and a tuple",
    "exceptions in Python",
    "unit testing",
    "version control with git",
    "how HTTP requests work",
    "object-oriented programming",
    "generators and the yield keyword",
    "big-O notation",
    "regular expressions",
    "virtual environments",
    "the Python GIL",
    "JSON",
    "SQL joins",
    "photosynthesis",
    "how vaccines work",
    "the water cycle",
    "why the sky is blue",
    "compound interest",
    "how a bicycle stays upright",
    "the causes of the seasons",
    "what a black hole is",
    "how to make a good cup of tea",
    "the rules of chess",
    "how to write a cover letter",
    "healthy sleep habits",
    "the history of the printing press",
)
CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Can you show me Python code that {task}? Explain it briefly.",
    "Implement a function in Python that {task}, with a docstring.",
)
TOPIC_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What should a beginner know about {topic}?",
    "Give me three short facts about {topic}.",
)


def prompts() -> list[str]:
    """Every instruction prompt, in a fixed order."""
    code = [t.format(task=task) for t, task in itertools.product(CODE_TEMPLATES, CODE_TASKS)]
    topic = [t.format(topic=name) for t, name in itertools.product(TOPIC_TEMPLATES, TOPICS)]
    return code + topic


SELF_INSTRUCT_OPENINGS = ("", "", "", "Write a Python", "How do I", "Can you write a function")
"""Words a self-instructed request starts with, one per batch in turn ("": the target's own
choice)."""
COMPLETION_TEMPLATES = (
    "Complete this Python function:\n```python\n{code}```",
    "Finish the implementation of this function:\n```python\n{code}```",
    "Write the body of this Python function.\n\n```python\n{code}```",
)


@torch.inference_mode()
def self_instruct(
    target: Any, tokenizer: Any, count: int, seed: int = 0, max_new_tokens: int = 64,
    batch: int = 32,
) -> list[str]:  # fmt: skip
    """``count`` distinct user requests written by the target: its chat template up to the
    user's text, then sampled (temperature 1, top-p 0.98) until the end of the turn; requests cut
    off by ``max_new_tokens`` are dropped."""
    marker = "\x00"
    ids, _ = chat_ids(tokenizer, marker)
    text = tokenizer.decode(ids)
    opening = text[: text.index(marker)]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(end, int) or end == tokenizer.unk_token_id:
        end = tokenizer.eos_token_id
    torch.manual_seed(seed)
    found: dict[str, None] = {}
    bar = tqdm(total=count, desc="self-instruct", unit="prompt", file=sys.stderr)
    for turn in itertools.count():
        if len(found) >= count:
            break
        start = SELF_INSTRUCT_OPENINGS[turn % len(SELF_INSTRUCT_OPENINGS)]
        head = tokenizer(opening + start, add_special_tokens=False)["input_ids"]
        inputs = torch.tensor([head] * batch)
        generated = target.generate(
            inputs, attention_mask=torch.ones_like(inputs),
            do_sample=True, temperature=1.0, top_p=0.98, top_k=None, max_new_tokens=max_new_tokens,
            eos_token_id=end, pad_token_id=end,
        )  # fmt: skip
        for row in generated[:, len(head) :].tolist():
            if end not in row:
                continue
            request = (start + tokenizer.decode(row[: row.index(end)])).strip()
            if len(request) >= 12 and request not in found and len(found) < count:
                found[request] = None
                bar.update(1)
    bar.close()
    return list(found)


def completion_prompts(texts: list[str], count: int, seed: int = 0) -> list[str]:
    """Up to ``count`` requests to complete a standard-library function, each its signature and
    docstring (functions of at most 40 lines whose docstring has at least 40 characters)."""
    found: list[str] = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc is None or len(doc) < 40 or node.end_lineno is None:
                continue
            if node.end_lineno - node.lineno > 40 or node.col_offset:
                continue
            body = node.body[0]
            if body.end_lineno is None:
                continue
            code = "\n".join(lines[node.lineno - 1 : body.end_lineno]) + "\n"
            found.append(code)
    rng = random.Random(seed)
    rng.shuffle(found)
    return [COMPLETION_TEMPLATES[i % len(COMPLETION_TEMPLATES)].format(code=code)
            for i, code in enumerate(found[:count])]  # fmt: skip


def held_out(prompt: str, fraction: float = 0.1) -> bool:
    """Whether ``prompt`` belongs to the held-out split (a stable hash of its text)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return digest[0] < 256 * fraction


@torch.inference_mode()
def answers(
    target: Any, tokenizer: Any, texts: list[str], max_new_tokens: int = 160, batch: int = 16
) -> list[list[int]]:
    """For each prompt, its chat-template ids followed by the target's greedy answer (up to the
    end of turn)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[list[int]] = []
    bar = tqdm(total=len(texts), desc="chat answers", unit="prompt", file=sys.stderr)
    for start in range(0, len(texts), batch):
        encoded = [chat_ids(tokenizer, text)[0] for text in texts[start : start + batch]]
        width = max(len(ids) for ids in encoded)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in encoded])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded])
        generated = target.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad,
        )  # fmt: skip
        for prompt_ids, row in zip(encoded, generated[:, width:].tolist(), strict=True):
            answer = row[: row.index(eos) + 1] if eos in row else row
            out.append(prompt_ids + answer)
        bar.update(len(encoded))
    bar.close()
    return out
