"""Ingest stage on real files and a real local Ray: every input format, rejects with reasons, dedupe, turns,
strict mode, errors before work, idempotent versioned output."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_an_empty_messages_list_is_rejected_as_empty_messages_not_as_a_wrong_type():
    from eagle3_ray.ingest.formats import Reject, normalise

    with pytest.raises(Reject) as err:
        normalise({"messages": []}, "all")
    assert (err.value.reason, err.value.detail) == (
        "empty_messages",
        "messages is an empty list: a conversation needs at least a user turn",
    )


def test_a_null_prompt_is_rejected_naming_the_null_column_not_as_no_known_column():
    from eagle3_ray.ingest.formats import Reject, normalise

    with pytest.raises(Reject) as err:
        normalise({"prompt": None, "system": "Be brief."}, "first")
    assert (err.value.reason, err.value.detail) == ("null_column", "prompt is null")
