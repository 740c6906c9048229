"""Train stage: speculators' EAGLE-3 drafter trained by a Ray Train TorchTrainer, a checkpoint every epoch, resumed
after failures; then export to a directory vLLM serves as an eagle3 speculator.

Follow it in this order: `stage.py` (the TorchTrainer, vocab, samples) -> `worker.py` (the loop every worker runs)
-> `data.py` (shards -> packed batches) -> `checkpoints.py` -> `acceptance.py` (the serving-faithful estimate).
Online training is a data source of the same loop: `online.py` (driver side), `online_engine.py` (the engine actor
streaming rows), `online_worker.py` (rows -> batches). `export.py` is the export stage.
"""
