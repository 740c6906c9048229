"""The GPU training bench's CPU-runnable parts at tiny size: both data formats hold the same samples and our step
is timed (speculators' CLI side needs CUDA and runs only on the lent GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_train_bench as gb  # noqa: E402


def test_tiny_bench_writes_both_formats_with_the_same_samples_and_times_our_step(tmp_path):
    from speculators.train.data import ArrowDataset

    verifier = gb.write_verifier(str(tmp_path / "verifier"), gb.TINY, "cpu")
    samples = gb.make_samples(12, 20, 40, len(gb.AUX_TINY) + 1, gb.TINY["hidden_size"], gb.TINY["vocab_size"])
    gen_dir, spec_dir = gb.write_both_formats(str(tmp_path), verifier, gb.TINY, gb.AUX_TINY, samples)
    vocab_dir = gb.write_vocabs(str(tmp_path), gen_dir, spec_dir, 128, gb.TINY["vocab_size"])

    spec = ArrowDataset(max_len=128, datapath=spec_dir, on_missing="raise", hidden_states_dtype=torch.float32)
    assert len(spec) == 12
    first = gb.make_samples(1, 20, 40, len(gb.AUX_TINY) + 1, gb.TINY["hidden_size"], gb.TINY["vocab_size"])
    ids, _mask, hs = next(first)
    item = spec[0]
    assert torch.equal(item["input_ids"], ids[: hs.shape[0]])
    assert torch.equal(item["verifier_last_hidden_states"].float(), hs[:, -1].float())

    result = gb.time_ours(gen_dir, vocab_dir, total_seq_len=96, draft_vocab=128, use_gpu=False, num_steps=3,
                          warmup=1, num_loader_workers=0)
    assert result["steps"] == 3 and result["tokens_per_s"] > 0 and 0 <= result["data_wait_frac"] < 1
    assert 0 < result["tokens_per_step"] <= 96
