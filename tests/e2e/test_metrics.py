"""The project's custom metrics reach Prometheus: the head node's metrics endpoint (`ray start
--metrics-export-port`) serves them as `ray_eagle3_*`, tagged with stage and run, while the submitted pipeline runs."""

from __future__ import annotations

import pytest

from eagle3_ray.core import storage

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _names(job, stage: str) -> set[str]:
    return {name for name, labels, _ in job.metrics if labels.get("stage") == stage and labels.get("run") == "full"}


def test_pipeline_driver_reports_each_stage_on_the_metrics_endpoint(pipeline_job):
    done = {
        labels["stage"]
        for name, labels, value in pipeline_job.metrics
        if name == "ray_eagle3_pipeline_stages_done_total" and value >= 1
    }
    # The last stage's counter may be set after the final scrape (the driver exits right after it).
    assert {"ingest", "generate", "train", "export"} <= done


@pytest.mark.parametrize("stage", ["ingest", "generate", "train"])
def test_stage_metrics_are_exported_with_the_ray_eagle3_prefix(pipeline_job, stage):
    names = _names(pipeline_job, stage) - {
        "ray_eagle3_pipeline_stage_running",
        "ray_eagle3_pipeline_stage_seconds",
        "ray_eagle3_pipeline_stages_done_total",
    }
    assert names, f"no ray_eagle3_* metric from the {stage} stage itself was scraped"


def test_ingest_row_counters_add_up_to_the_rows_read(pipeline_job, s3_env):
    latest: dict[str, float] = {}
    for name, labels, value in pipeline_job.metrics:
        if name == "ray_eagle3_ingest_rows_total" and labels.get("run") == "full":
            latest[labels["reason"]] = max(value, latest.get(labels["reason"], 0))
    summary = storage.read_json(storage.join(storage.latest(pipeline_job.run_dir, "ingest")["path"], "summary.json"))
    # Rows are counted as ok or by reject code when normalised; duplicates among the ok rows are counted apart.
    assert sum(v for reason, v in latest.items() if reason != "duplicate") == summary["rows_in"]
    assert latest.get("duplicate", 0) == summary["duplicates"]
