"""Fixtures built through the library's own functions: a tiny run's generate output, drafters, ingest data, a Ray
head and an S3 server on loopback, process helpers."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
