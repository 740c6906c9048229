"""bench/gpu/parity.py: the conversion of a generate output into speculators' data format, read back by speculators'
own dataset class (the same tokens, loss masks and hidden states of our training split, and the run's own draft
vocabulary), and the served copy of a speculators checkpoint that vLLM 0.24 reads as it was trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from bench.gpu import parity
from eagle3_ray.core import sample_ids, shards
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.train import data, vocab
from tests.support.generate_output import shared_generate_output

pytestmark = pytest.mark.unit


def _two_responses_per_prompt(gen_dir: str, out: Path) -> str:
    """The generate output as generate.responses_per_prompt=2 lays it out: each prompt's greedy sample `<id>` and a
    second sample `<id>#1` (here the same tokens and hidden states)."""
    out.mkdir()
    (out / "shards").symlink_to(f"{gen_dir}/shards", target_is_directory=True)
    for name in ("manifest", "conversations"):
        table = pq.read_table(f"{gen_dir}/{name}.parquet")
        rows = table.to_pylist()
        second = [{**r, "id": sample_ids.response_id(r["id"], 1)} for r in rows]
        pq.write_table(pa.Table.from_pylist(rows + second, schema=table.schema), out / f"{name}.parquet")
    return str(out)


def test_speculators_dataset_reads_back_every_sample_of_our_training_split_with_the_runs_vocabulary(
    tmp_path, tmp_path_factory, tiny_llama
):
    """Only our training split: the validation prompts' greedy samples and their sampled responses (held out from our
    training too: data.split_role) reach neither drafter."""
    from speculators.train.data import ArrowDataset

    src = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    gen_dir = _two_responses_per_prompt(src, tmp_path / "gen")
    cfg = config_from_dict(
        {"generate": {"responses_per_prompt": 2, "temperature": 0.7}, "train": {"val_fraction": 0.2}}
    )
    conversations = {r["id"]: r for r in pq.read_table(f"{gen_dir}/conversations.parquet").to_pylist()}
    counts = vocab.count_tokens((r["input_ids"], r["loss_mask"]) for r in conversations.values())

    manifest = sorted(pq.read_table(f"{gen_dir}/manifest.parquet").to_pylist(), key=lambda m: m["id"])
    roles = {m["id"]: data.split_role(m["id"], cfg) for m in manifest}
    assert {"train", "val", "held_out"} <= set(roles.values())
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    (train_dir / "split.json").write_text(json.dumps({"val_ids": sorted(i for i, r in roles.items() if r == "val")}))
    vocab_dir = str(train_dir / "vocab")
    verifier_vocab = json.loads(open(f"{src}/capture.json").read())["vocab_size"]
    vocab.save_vocab(vocab_dir, *vocab.build_vocab(counts, 64, verifier_vocab), counts)

    with pytest.raises(ValueError, match="is not a validation sample under the config given"):
        other = config_from_dict({"generate": {"responses_per_prompt": 2, "temperature": 0.7}})  # val_fraction 0.1
        parity.write_speculators_data(gen_dir, str(train_dir), str(tmp_path / "spec-other"), other)

    spec_dir = str(tmp_path / "spec")
    counts_out = parity.write_speculators_data(gen_dir, str(train_dir), spec_dir, cfg)

    trained = [m for m in manifest if roles[m["id"]] == "train"]
    assert counts_out == {
        "samples": len(trained),
        "held_out": len(manifest) - len(trained),
        "tokens": sum(m["num_tokens"] for m in trained),
        "draft_vocab_size": 64,
    }
    dataset = ArrowDataset(max_len=4096, datapath=spec_dir, on_missing="raise", hidden_states_dtype=torch.bfloat16)
    assert len(dataset) == len(trained) < len(manifest)
    for i in range(len(trained)):
        m, item = trained[i], dataset[i]
        t, conv = m["num_tokens"], conversations[m["id"]]
        assert item["input_ids"].tolist() == conv["input_ids"][:t]
        assert item["loss_mask"].tolist() == conv["loss_mask"][:t]
        if i in (0, len(trained) // 2, len(trained) - 1):
            hs = shards.read_sample(f"{gen_dir}/shards/{m['shard']}", m["key"], torch.bfloat16)
            assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))  # the aux layers, side by side
            assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])  # the final layer: the target
    for name in ("d2t", "t2d"):
        assert np.array_equal(np.load(f"{spec_dir}/{name}-64.npy"), np.load(f"{vocab_dir}/{name}.npy"))


def test_a_speculators_checkpoint_is_served_with_its_drafter_flags_where_vllm_0_24_reads_them(
    tmp_path, tmp_path_factory, tiny_llama
):
    """speculators saves norm_output at the top level of its config only; vLLM 0.24's loader drops it there, and the
    serving contract refuses the checkpoint as saved. The served copy carries every flag where that loader reads it,
    with the same values and the same weights."""
    from eagle3_ray.core import contract
    from eagle3_ray.train import worker

    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    capture = json.loads(open(f"{gen_dir}/capture.json").read())
    conversations = pq.read_table(f"{gen_dir}/conversations.parquet").to_pylist()
    counts = vocab.count_tokens((r["input_ids"], r["loss_mask"]) for r in conversations)
    vocab_dir = str(tmp_path / "vocab")
    vocab.save_vocab(vocab_dir, *vocab.build_vocab(counts, 64, capture["vocab_size"]), counts)
    cfg = config_from_dict(
        {
            "verifier": {"path": tiny_llama, "aux_layer_ids": capture["aux_layer_ids"]},
            "train": {"draft_vocab_size": 64},
            "export": {"serving_vllm_version": "0.24"},
        }
    )
    theirs = tmp_path / "speculators_ckpt" / "2"
    worker.build_model(cfg, capture, vocab_dir, torch.device("cpu")).save_pretrained(theirs)  # as its Trainer saves
    saved = json.loads((theirs / "config.json").read_text())
    assert saved["norm_output"] is True
    with pytest.raises(ValueError, match="norm_output=True is not carried over"):
        contract.check_serving(saved, "0.24", where=str(theirs), num_hidden_layers=capture["num_hidden_layers"])

    served = parity.served_copy(str(theirs), cfg, capture, tiny_llama, str(tmp_path / "served"))
    config = json.loads(open(f"{served}/config.json").read())
    checked = contract.check_serving(config, "0.24", where=served, num_hidden_layers=capture["num_hidden_layers"])
    assert checked["flags"] == {flag: saved[flag] for flag in contract.DRAFTER_FLAGS}
    assert config["eagle_aux_hidden_state_layer_ids"] == capture["aux_layer_ids"]
    weights = sorted(p.name for p in theirs.iterdir() if p.name != "config.json")
    assert weights and all((theirs / w).read_bytes() == open(f"{served}/{w}", "rb").read() for w in weights)
