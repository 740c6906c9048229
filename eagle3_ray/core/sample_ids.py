"""Sample ids: a regenerated response's id from its prompt's, and back.

response_id("abc", 0) == "abc"; response_id("abc", 2) == "abc#2"; prompt_of("abc#2") == "abc"
"""

from __future__ import annotations


def response_id(prompt_id: str, k: int) -> str:
    """The sample id of a prompt's k-th regenerated response (generate.responses_per_prompt): the prompt's own id for
    k = 0, `<prompt id>#<k>` after it. Ingested ids never end in `#<digits>` (content hashes, `sharegpt:<id>`)."""
    return prompt_id if k == 0 else f"{prompt_id}#{k}"


def prompt_of(sample_id: str) -> str:
    """The prompt id a sample id was made from (response_id's inverse): samples of one prompt share it."""
    base, sep, k = sample_id.rpartition("#")
    return base if sep and k.isdigit() else sample_id


def is_greedy_response(sample_id: str, temperature: float, responses_per_prompt: int) -> bool:
    """Whether generate decodes this sample's response greedily: every one at temperature 0; with several responses
    per prompt, the first (k = 0, the prompt's own id) is the greedy one and the others are sampled at
    `temperature`, so each prompt has the response greedy serving decodes, which training's estimate replays."""
    return temperature == 0 or (responses_per_prompt > 1 and prompt_of(sample_id) == sample_id)
