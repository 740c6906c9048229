"""bench/gpu/parity.py's conversion of a generate output into speculators' data format, read back by speculators' own
dataset class: the same tokens, loss masks and hidden states, and the run's own draft vocabulary."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_ray.core import shards
from eagle3_ray.train import vocab
from tests.support import REPO
from tests.support.generate_output import shared_generate_output

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import parity  # noqa: E402

pytestmark = pytest.mark.unit


def test_speculators_dataset_reads_back_every_captured_sample_with_the_runs_vocabulary(
    tmp_path, tmp_path_factory, tiny_llama
):
    from speculators.train.data import ArrowDataset

    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    conversations = {r["id"]: r for r in pq.read_table(f"{gen_dir}/conversations.parquet").to_pylist()}
    counts = vocab.count_tokens((r["input_ids"], r["loss_mask"]) for r in conversations.values())
    vocab_dir = str(tmp_path / "vocab")
    verifier_vocab = json.loads(open(f"{gen_dir}/capture.json").read())["vocab_size"]
    vocab.save_vocab(vocab_dir, *vocab.build_vocab(counts, 64, verifier_vocab), counts)

    spec_dir = str(tmp_path / "spec")
    counts_out = parity.write_speculators_data(gen_dir, vocab_dir, spec_dir)

    manifest = sorted(pq.read_table(f"{gen_dir}/manifest.parquet").to_pylist(), key=lambda m: m["id"])
    assert counts_out == {
        "samples": len(manifest),
        "tokens": sum(m["num_tokens"] for m in manifest),
        "draft_vocab_size": 64,
    }
    dataset = ArrowDataset(max_len=4096, datapath=spec_dir, on_missing="raise", hidden_states_dtype=torch.bfloat16)
    assert len(dataset) == len(manifest)
    for i in (0, len(manifest) // 2, len(manifest) - 1):
        m, item = manifest[i], dataset[i]
        t, conv = m["num_tokens"], conversations[m["id"]]
        hs = shards.read_sample(f"{gen_dir}/shards/{m['shard']}", m["key"], torch.bfloat16)
        assert item["input_ids"].tolist() == conv["input_ids"][:t]
        assert item["loss_mask"].tolist() == conv["loss_mask"][:t]
        assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))  # the aux layers, side by side
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])  # the final layer: the target
    for name in ("d2t", "t2d"):
        assert np.array_equal(np.load(f"{spec_dir}/{name}-64.npy"), np.load(f"{vocab_dir}/{name}.npy"))
