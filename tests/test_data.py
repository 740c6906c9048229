"""Shard reading, packing/alignment and bad-input handling of the training data (no Ray)."""

from __future__ import annotations

import shutil

import pytest
import torch
from fixtures_generate import shared_generate_output

from eagle3_ray import data, shards, storage
from eagle3_ray.config import config_from_dict
from eagle3_ray.train import prepare_samples


@pytest.fixture(scope="session")
def gen_dir(tmp_path_factory, tiny_llama) -> str:
    return shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)


@pytest.fixture()
def gen_copy(gen_dir, tmp_path) -> str:
    """A private copy of the generate output to corrupt."""
    return str(shutil.copytree(gen_dir, tmp_path / "gen"))


def _cfg(**train) -> object:
    return config_from_dict({"train": {"num_workers": 2, **train}})


def _refs(gen: str) -> tuple[list[data.SampleRef], dict]:
    capture = storage.read_json(f"{gen}/capture.json")
    return prepare_samples(gen, capture, _cfg(on_bad_sample="skip"))[0], capture


def test_samples_hold_aux_layers_concatenated_and_the_final_layer_as_target(gen_dir):
    refs, capture = _refs(gen_dir)
    ds = data.ShardDataset(refs, num_aux=3)
    sample = ds[0]
    stored = shards.read_sample(refs[0].shard_path, refs[0].key)  # shape: [T, 4, H]
    assert sample["hidden_states"].shape == (refs[0].num_tokens, 3 * capture["hidden_size"])
    assert torch.equal(sample["hidden_states"][:, 256:512], stored[:, 1])
    assert torch.equal(sample["verifier_last_hidden_states"], stored[:, 3])
    assert sample["input_ids"].tolist() == refs[0].input_ids and sample["loss_mask"].sum() > 0


def test_packed_batches_are_shifted_by_one_as_eagle3_requires(gen_dir):
    refs, _ = _refs(gen_dir)
    ds = data.ShardDataset(refs, num_aux=3)
    loader = data.make_loader(ds, total_seq_len=256, hidden_size=256, world_size=1, rank=0, seed=0, num_workers=0)
    batch = next(iter(loader))
    first = loader.batch_sampler._generate_batches(0)[0][0]  # the first packed sample of the first batch
    raw, n = ds[first], refs[first].num_tokens - 1
    assert batch["input_ids"][0, :n].tolist() == raw["input_ids"][1:].tolist()          # x1 ...
    assert torch.equal(batch["hidden_states"][0, :n], raw["hidden_states"][:-1])        # g0 ...
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n], raw["verifier_last_hidden_states"][1:])  # y1
    assert batch["loss_mask"][0, :n].tolist() == raw["loss_mask"][1:].tolist()          # l1 ...
    assert batch["input_ids"].shape == (1, 256) and (batch["document_ids"][0, :n] == 0).all()


def test_fp8_shards_decode_close_to_bf16(gen_dir, tmp_path):
    refs, _ = _refs(gen_dir)
    ref = refs[0]
    hs = shards.read_sample(ref.shard_path, ref.key)
    path = str(tmp_path / "fp8.safetensors")
    shards.write_shard(path, shards.encode_sample(ref.key, hs, "fp8"))
    fp8_ref = data.SampleRef(ref.id, path, ref.key, ref.num_tokens, ref.input_ids, ref.loss_mask)
    decoded = data.ShardDataset([fp8_ref], num_aux=3)[0]["verifier_last_hidden_states"]
    rel = (decoded - hs[:, 3]).norm() / hs[:, 3].norm()
    assert rel < 0.05


def test_truncated_and_missing_shards_are_reported_with_the_file_named(gen_copy):
    first, second = sorted(storage.list_files(f"{gen_copy}/shards", ".safetensors"))[:2]
    with open(first, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    storage.delete(second)
    capture = storage.read_json(f"{gen_copy}/capture.json")
    with pytest.raises(data.BadSampleError, match=r"shard-0000[01]\.safetensors: (truncated|shard file is missing)"):
        prepare_samples(gen_copy, capture, _cfg(on_bad_sample="fail"))
    refs, problems = prepare_samples(gen_copy, capture, _cfg(on_bad_sample="skip"))
    assert {p.split(":")[0] for p in problems.values()} == {first, second}
    assert len(refs) + len(problems) == 40


def test_manifest_disagreeing_with_shards_is_reported(gen_copy):
    import pyarrow as pa

    rows = storage.read_parquet(f"{gen_copy}/manifest.parquet").to_pylist()
    rows[0]["num_tokens"] -= 1
    rows[1]["key"] = "no-such-key"
    storage.write_parquet_atomic(f"{gen_copy}/manifest.parquet",
                                 pa.Table.from_pylist(rows, schema=shards.MANIFEST_SCHEMA))
    capture = storage.read_json(f"{gen_copy}/capture.json")
    _, problems = prepare_samples(gen_copy, capture, _cfg(on_bad_sample="skip"))
    assert "manifest says" in problems[rows[0]["id"]] and rows[0]["shard"] in problems[rows[0]["id"]]
    assert "no-such-key.hs" in problems[rows[1]["id"]] and "missing" in problems[rows[1]["id"]]


def test_non_finite_hidden_states_fail_or_are_skipped_and_counted(gen_copy):
    refs, _ = _refs(gen_copy)
    ref = refs[0]
    tensors = shards.load_shard(ref.shard_path)
    tensors[f"{ref.key}.hs"] = tensors[f"{ref.key}.hs"].clone()
    tensors[f"{ref.key}.hs"][3, 1, 7] = float("nan")
    shards.write_shard(ref.shard_path, tensors)
    with pytest.raises(data.BadSampleError, match=rf"{ref.shard_path} key {ref.key}.*layer 3: 1 non-finite values"):
        data.ShardDataset(refs, num_aux=3, layer_ids=[1, 3, 4, 6], on_bad_sample="fail")[0]
    skipping = data.ShardDataset(refs, num_aux=3, on_bad_sample="skip")
    loader = data.make_loader(skipping, total_seq_len=4096, hidden_size=256, world_size=1, rank=0, seed=0,
                              num_workers=0)
    assert sum(b["error_records"] for b in loader) == 1


def test_a_sample_with_all_zero_rows_in_a_layer_fails_on_load_naming_shard_and_layer(gen_copy):
    refs, _ = _refs(gen_copy)
    ref = refs[0]
    tensors = shards.load_shard(ref.shard_path)
    hs = tensors[f"{ref.key}.hs"].clone()
    hs[:, 2] = 0  # what vLLM's wrong hidden-state slot mapping hands out: a layer of zeros
    tensors[f"{ref.key}.hs"] = hs
    shards.write_shard(ref.shard_path, tensors)
    ds = data.ShardDataset(refs, num_aux=3, layer_ids=[1, 3, 4, 6], on_bad_sample="fail")
    with pytest.raises(data.BadSampleError, match=rf"{ref.shard_path} key {ref.key}.*layer 4: {ref.num_tokens} of "
                                                  rf"{ref.num_tokens} token rows are all zero"):
        ds[0]


def test_aux_layer_mismatch_is_an_error_before_training(gen_dir):
    capture = storage.read_json(f"{gen_dir}/capture.json")
    cfg = config_from_dict({"verifier": {"aux_layer_ids": [1, 2, 4]}})
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 2, 4\].*captured aux layers \[1, 3, 4\]"):
        prepare_samples(gen_dir, capture, cfg)
    wrong = {**capture, "aux_layer_ids": [1, 3], "layer_ids": [1, 3, 6]}
    with pytest.raises(ValueError, match="manifest.parquet: layer_ids"):
        prepare_samples(gen_dir, wrong, _cfg())


def test_validation_split_is_stable_by_id():
    ids = [f"{i:016x}" for i in range(2000)]
    held = [i for i in ids if data.is_validation(i, 0.1)]
    assert 150 < len(held) < 250
    assert held == [i for i in reversed(ids) if data.is_validation(i, 0.1)][::-1]


def test_greedy_packer_keeps_order_fills_to_the_budget_and_gives_an_oversized_item_its_own_group():
    from eagle3_ray.shards import greedy_groups

    assert greedy_groups([3, 4, 2, 9, 1, 5], budget=7) == [[0, 1], [2], [3], [4, 5]]
    assert greedy_groups([7, 7], budget=7) == [[0], [1]] and greedy_groups([], budget=7) == []
