"""Evaluate stage: decode held-out prompts in vLLM with and without the exported drafter, measure acceptance and
speedup, and gate deployment (`stage.py`); `report.py` writes the rows, the Markdown report and the plots."""
