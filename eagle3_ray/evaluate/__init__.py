"""Evaluate stage: decode held-out prompts in vLLM with and without the exported drafter, measure acceptance and
speedup, recommend a draft length per concurrency and gate deployment (`stage.py`, its engine actor in `engine.py`);
`identity.py` tells the drafter's output changes from batch numerics, `gate.py` picks k and applies the thresholds,
`report.py` writes the rows, the Markdown report and the plots."""
