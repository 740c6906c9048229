"""Online training's config: switching train.source changes only where samples come from (the runs themselves:
tests/e2e/test_online.py)."""

from __future__ import annotations

import pytest

from tests.support.configs import online_cfg

pytestmark = pytest.mark.unit


def test_online_switch_changes_only_the_data_source(tmp_path):
    offline = online_cfg(tmp_path, "tiny:llama", "x", source="offline")
    online = online_cfg(tmp_path, "tiny:llama", "x")
    a, b = offline.to_dict(), online.to_dict()
    assert a["train"].pop("source") == "offline" and b["train"].pop("source") == "online"
    assert a == b
    with pytest.raises(ValueError, match="train.online_max_samples"):
        online_cfg(tmp_path, "tiny:llama", "x", online_max_samples=0)
