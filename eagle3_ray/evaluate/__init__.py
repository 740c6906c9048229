"""Evaluate stage: decode held-out prompts in vLLM with and without the exported drafter, measure acceptance and
speedup, recommend a draft length per concurrency and gate deployment (`stage.py`). `prompts.py` loads and tokenizes
the prompts, `measure.py` runs the engines one after another (each an actor of `engine.py`), `identity.py` tells the
drafter's output changes from batch numerics (`recheck.py`: again in float32), `prediction.py` sets training's
estimate next to the measurement, `gate.py` picks k and applies the thresholds, `report.py` writes the rows, the
Markdown report and the plots."""
