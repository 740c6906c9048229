"""`builtin:tiny_prompts`: a deterministic set of Python/coding chat prompts generated from templates, so the tiny
pipeline runs with no downloads.

    from eagle3_ray.core.prompts import tiny_prompts
    train = tiny_prompts()                # 200 conversations in OpenAI `messages` form, some multi-turn
    held_out = tiny_prompts(split="eval")  # disjoint from train: the evaluate stage decodes these

Every (task, subject) combination is made once, shuffled with the seed, and cut into a train part and an eval part,
so the two splits never share a prompt.
"""

from __future__ import annotations

import random
from typing import Literal

SYSTEM_PROMPT = "You are a concise assistant who writes correct, idiomatic Python."

TASKS = [
    "Write a Python function that {subject}.",
    "Explain step by step how to {subject_verb} in Python.",
    "Give a short Python example that {subject}, with a docstring and type hints.",
    "What is the most efficient way to {subject_verb} in Python? Compare two approaches.",
    "Write a unit test with pytest for a function that {subject}.",
    "Refactor this idea into a small Python class: a helper that {subject}.",
    "Which standard library modules help to {subject_verb}? Show how to use one of them.",
    "Write a Python command-line script that {subject} and prints the result.",
    "I wrote a function that {subject}, but it is slow on large inputs. What should I profile first?",
    "Describe the time and space complexity of a function that {subject}.",
]

# (third person for "a function that ...", infinitive for "how to ...")
SUBJECTS = [
    ("reverses the words in a sentence", "reverse the words in a sentence"),
    ("counts how often each character occurs in a string", "count how often each character occurs in a string"),
    ("merges two sorted lists into one sorted list", "merge two sorted lists"),
    ("checks whether a string is a palindrome", "check whether a string is a palindrome"),
    ("parses a CSV file into a list of dictionaries", "parse a CSV file into dictionaries"),
    ("finds the n largest numbers in a list", "find the n largest numbers in a list"),
    ("flattens a nested list of arbitrary depth", "flatten a nested list"),
    ("reads a JSON file and validates required keys", "validate the keys of a JSON document"),
    ("computes the Fibonacci numbers up to n with memoization", "compute Fibonacci numbers with memoization"),
    ("removes duplicate items from a list while keeping order", "deduplicate a list while keeping order"),
    ("groups words by their first letter", "group words by their first letter"),
    ("converts a Roman numeral to an integer", "convert Roman numerals to integers"),
    ("retries a function call with exponential backoff", "retry a call with exponential backoff"),
    ("walks a directory tree and sums file sizes", "sum file sizes in a directory tree"),
    ("implements binary search on a sorted list", "implement binary search"),
    ("validates an email address with a regular expression", "validate email addresses with a regex"),
    ("caches the results of an expensive function", "cache the results of an expensive function"),
    ("splits a list into chunks of a given size", "split a list into fixed-size chunks"),
    ("computes a moving average over a stream of numbers", "compute a moving average over a stream"),
    ("transposes a matrix given as a list of lists", "transpose a matrix"),
    ("formats a number of bytes as a human-readable string", "format byte counts for humans"),
    ("detects a cycle in a linked list", "detect a cycle in a linked list"),
    ("runs several HTTP requests concurrently with asyncio", "run HTTP requests concurrently with asyncio"),
    ("serialises a dataclass to JSON and back", "serialise dataclasses to JSON"),
    ("parses command-line arguments with argparse", "parse command-line arguments"),
    ("computes the longest common prefix of several strings", "find the longest common prefix of strings"),
    ("builds a simple LRU cache with OrderedDict", "build an LRU cache"),
    ("times how long a block of code takes with a context manager", "time a block of code with a context manager"),
    ("sorts a list of dictionaries by two keys", "sort dictionaries by two keys"),
    ("tokenises an arithmetic expression and evaluates it", "evaluate an arithmetic expression safely"),
]

FOLLOW_UPS = [
    "Can you make it handle empty input as well?",
    "Now add type hints and a docstring.",
    "How would you test the edge cases?",
    "Can you make it faster for very large inputs?",
    "Rewrite it without using any imports.",
]

ANSWER_OPENERS = [
    "Here is a straightforward version:\n\n```python\ndef solve(data):\n    return data\n```",
    "One way is to keep it small and explicit:\n\n```python\ndef helper(items):\n    result = []\n"
    "    for item in items:\n        result.append(item)\n    return result\n```",
]

Split = Literal["train", "eval"]
NUM_TRAIN = 200


def _all_user_prompts() -> list[str]:
    return [task.format(subject=s, subject_verb=v) for task in TASKS for s, v in SUBJECTS]


def _conversation(prompt: str, rng: random.Random, *, multi_turn: bool) -> dict:
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": prompt})
    if multi_turn:
        messages.append({"role": "assistant", "content": rng.choice(ANSWER_OPENERS)})
        messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
    return {"messages": messages}


def tiny_prompts(split: Split = "train", *, num_prompts: int | None = None, seed: int = 0) -> list[dict]:
    """Conversations (`{"messages": [...]}`) of the train split (200 by default, every fifth multi-turn) or of the
    held-out eval split (the remaining prompts, single-turn). Same arguments, same list."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    prompts = _all_user_prompts()  # 10 tasks x 30 subjects = 300 distinct prompts
    random.Random(seed).shuffle(prompts)
    chosen = prompts[:NUM_TRAIN] if split == "train" else prompts[NUM_TRAIN:]
    if num_prompts is not None:
        if num_prompts > len(chosen):
            raise ValueError(f"num_prompts: the {split} split has {len(chosen)} prompts, asked for {num_prompts}")
        chosen = chosen[:num_prompts]
    rng = random.Random(f"{seed}-{split}")
    return [_conversation(p, rng, multi_turn=split == "train" and i % 5 == 4) for i, p in enumerate(chosen)]
