"""Ingest stage: prompt files and built-in prompt sets -> one deduplicated conversation table plus a rejects table
(`stage.py` runs it on Ray Data; `formats.py` reads and normalises each input format)."""
