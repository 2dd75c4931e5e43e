"""Chat data for ``train_draft.py``: the target's own answers to instruction prompts made here.

The prompts are templates filled with topics written for this project (no dataset, no
HumanEval): programming requests, explanations and everyday questions. The target answers each
greedily under its chat template, in batches, and the token ids (prompt and answer) are what
the draft trains on. ``held_out(prompt)`` splits them by a hash of the prompt.
"""

from __future__ import annotations

import hashlib
import itertools
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
