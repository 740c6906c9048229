"""Conversations for the generate and online tests; the library's `ingest.in_memory.write_output` makes them the
ingest output a config determines (without running Ray Data)."""

from __future__ import annotations

TOPICS = [
    "parse a csv file",
    "sort a list of tuples",
    "read a json config",
    "retry a network call",
    "merge two dicts",
    "walk a directory tree",
    "format a date",
    "count words in a file",
    "validate an email address",
    "compute a moving average",
    "flatten a nested list",
    "cache a function result",
]


def conversations(num_single: int = 24, num_multi: int = 4, long_words: int = 0) -> list[list[dict]]:
    convs = []
    for i in range(num_single):
        msgs = [{"role": "user", "content": f"Write a Python function to {TOPICS[i % len(TOPICS)]} (variant {i})."}]
        if i % 5 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a terse coding assistant."})
        convs.append(msgs)
    for i in range(num_multi):
        convs.append(
            [
                {"role": "user", "content": f"How do I {TOPICS[i]}?"},
                {"role": "assistant", "content": "An old answer that gets regenerated."},
                {"role": "user", "content": "Now add error handling and tests."},
                {"role": "assistant", "content": "Another old answer."},
            ]
        )
    if long_words:
        code = " ".join(["def f(x): return x"] * long_words)
        convs.append([{"role": "user", "content": "Explain this code: " + code}])
    return convs
