"""Shard reading, packing/alignment and bad-input handling of the training data (no Ray)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from eagle3_ray.core import capture_checks, shard_format, shards, storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.train import data
from eagle3_ray.train.stage import prepare_samples
from tests.support.generate_output import shared_generate_output

pytestmark = pytest.mark.unit


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
    first = loader.batch_sampler.batches(0)[0][0]  # the first packed sample of the first batch
    raw, n = ds[first], refs[first].num_tokens - 1
    assert batch["input_ids"][0, :n].tolist() == raw["input_ids"][1:].tolist()  # x1 ...
    assert torch.equal(batch["hidden_states"][0, :n], raw["hidden_states"][:-1])  # g0 ...
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n], raw["verifier_last_hidden_states"][1:])  # y1
    assert batch["loss_mask"][0, :n].tolist() == raw["loss_mask"][1:].tolist()  # l1 ...
    assert batch["input_ids"].shape == (1, 256) and (batch["document_ids"][0, :n] == 0).all()


def test_fp8_shards_decode_close_to_bf16(gen_dir, tmp_path):
    refs, _ = _refs(gen_dir)
    ref = refs[0]
    hs = shards.read_sample(ref.shard_path, ref.key)
    path = str(tmp_path / "fp8.safetensors")
    shards.write_shard(path, shard_format.encode_sample(ref.key, hs, "fp8"))
    fp8_ref = data.SampleRef(ref.id, path, ref.key, ref.num_tokens, ref.input_ids, ref.loss_mask)
    sample = data.ShardDataset([fp8_ref], num_aux=3)[0]
    assert sample["verifier_last_hidden_states"].dtype == torch.float8_e4m3fn  # decoded on the device, not here
    decoded = data.decode(sample, torch.float32)["verifier_last_hidden_states"]
    rel = (decoded - hs[:, 3].float()).norm() / hs[:, 3].float().norm()
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
    storage.write_parquet_atomic(
        f"{gen_copy}/manifest.parquet", pa.Table.from_pylist(rows, schema=shards.MANIFEST_SCHEMA)
    )
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
    loader = data.make_loader(
        skipping, total_seq_len=4096, hidden_size=256, world_size=1, rank=0, seed=0, num_workers=0
    )
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
    with pytest.raises(
        data.BadSampleError,
        match=rf"{ref.shard_path} key {ref.key}.*layer 4: {ref.num_tokens} of "
        rf"{ref.num_tokens} token rows are all zero",
    ):
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


def test_the_responses_of_one_prompt_are_samples_on_the_same_side_of_the_split():
    """generate.responses_per_prompt: the stage's samples are each ingested row n times in a row, ids `<id>#<k>`;
    the validation split hashes the prompt id, so no prompt trains on one response and validates on another."""
    import pyarrow as pa

    from eagle3_ray.core.config import config_from_dict
    from eagle3_ray.core.sample_ids import prompt_of, response_id
    from eagle3_ray.generate.plan import with_responses

    table = pa.table({"id": ["a1", "sharegpt:x_0"], "messages": [[{"role": "user", "content": "hi"}]] * 2})
    cfg = config_from_dict({"generate": {"responses_per_prompt": 3, "temperature": 0.7}})
    got = with_responses(table, cfg)
    assert got.column("id").to_pylist() == ["a1", "a1#1", "a1#2", "sharegpt:x_0", "sharegpt:x_0#1", "sharegpt:x_0#2"]
    assert got.column("messages").to_pylist() == [table.column("messages")[0].as_py()] * 6
    assert with_responses(table, config_from_dict({})) is table
    assert [prompt_of(i) for i in got.column("id").to_pylist()] == ["a1"] * 3 + ["sharegpt:x_0"] * 3
    assert prompt_of("a#b") == "a#b" and response_id("p", 0) == "p"
    ids = [f"{i:016x}" for i in range(500)]
    for i in ids:
        assert len({data.is_validation(response_id(i, k), 0.1) for k in range(4)}) == 1


def test_validation_holds_a_prompts_greedy_response_and_holds_its_sampled_ones_out_of_both_sides():
    """With several responses per prompt the first is greedy (sample_ids.is_greedy_response): the split validates on it,
    as greedy serving decodes, and keeps the same prompt's sampled responses out of training and validation alike;
    with one response per prompt every sample trains or validates, sampled or not."""
    from eagle3_ray.core.config import config_from_dict
    from eagle3_ray.core.sample_ids import is_greedy_response, response_id

    assert [is_greedy_response(response_id("p", k), 0.7, 3) for k in range(3)] == [True, False, False]
    assert is_greedy_response("p#1", 0.0, 1) and not is_greedy_response("p", 0.7, 1)
    gen = {"responses_per_prompt": 3, "temperature": 0.7}
    cfg = config_from_dict({"generate": gen, "train": {"val_fraction": 0.2}})
    prompts = [f"{i:016x}" for i in range(300)]
    roles = {p: [data.split_role(response_id(p, k), cfg) for k in range(3)] for p in prompts}
    val = [p for p in prompts if data.is_validation(p, 0.2)]
    assert 30 < len(val) < 90
    assert all(roles[p] == ["val", "held_out", "held_out"] for p in val)
    assert all(roles[p] == ["train"] * 3 for p in prompts if p not in val)
    single = config_from_dict({"generate": {"temperature": 0.7}, "train": {"val_fraction": 0.2}})
    assert {data.split_role(p, single) for p in val} == {"val"}


def test_greedy_packer_keeps_order_fills_to_the_budget_and_gives_an_oversized_item_its_own_group():
    from eagle3_ray.core.packing import greedy_groups

    assert greedy_groups([3, 4, 2, 9, 1, 5], budget=7) == [[0, 1], [2], [3], [4, 5]]
    assert greedy_groups([7, 7], budget=7) == [[0], [1]] and greedy_groups([], budget=7) == []


def test_interleaved_groups_spread_neighbours_over_the_shards_and_keep_each_within_the_budget():
    from eagle3_ray.core.packing import interleaved_groups

    assert interleaved_groups([2] * 7, budget=6) == [[0, 3, 6], [1, 4], [2, 5]]  # as many groups as greedy packing
    # round-robin over greedy's 3 groups would put 0 and 3 together (8 > 5): one more group keeps each within it
    assert interleaved_groups([4, 1, 4, 4], budget=5) == [[0], [1], [2], [3]]
    for sizes in ([5, 1, 1, 5, 1, 1, 5], [1] * 10, [8, 8]):
        groups = interleaved_groups(sizes, budget=7)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert all(len(g) == 1 or sum(sizes[i] for i in g) <= 7 for g in groups)
    assert interleaved_groups([], budget=7) == []


def _fp8_copy(gen_dir: str, tmp_path) -> list[data.SampleRef]:
    """The generate output's samples re-stored as fp8 shards (one file per source shard)."""
    refs, _ = _refs(gen_dir)
    out = []
    for path in sorted({r.shard_path for r in refs}):
        fp8_path = str(tmp_path / path.split("/")[-1])
        keys = [r.key for r in refs if r.shard_path == path]
        tensors = {}
        for key in keys:
            tensors.update(shard_format.encode_sample(key, shards.read_sample(path, key), "fp8"))
        shards.write_shard(fp8_path, tensors)
    for r in refs:
        out.append(
            data.SampleRef(
                r.id, str(tmp_path / r.shard_path.split("/")[-1]), r.key, r.num_tokens, r.input_ids, r.loss_mask
            )
        )
    return out


@pytest.mark.parametrize("stored", ["bfloat16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_workers,reuse", [(0, False), (2, False), (2, True)])
def test_packed_batches_decoded_on_the_device_equal_speculators_collate_of_host_decoded_samples(
    gen_dir, tmp_path, stored, dtype, num_workers, reuse
):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    refs = _refs(gen_dir)[0] if stored == "bfloat16" else _fp8_copy(gen_dir, tmp_path)
    ds = data.ShardDataset(refs, num_aux=3, dtype=dtype)
    longest = max(r.num_tokens for r in refs)
    for total in (longest - 3, 3 * longest):  # the longest sample cut at the budget; several samples per batch
        loader = data.make_loader(
            ds,
            total_seq_len=total,
            hidden_size=256,
            world_size=1,
            rank=0,
            seed=0,
            num_workers=num_workers,
            prefetch_factor=3,
            reuse_buffers=reuse,
        )
        before = CollateFn(total, 256, num_target_layers=3, dtype=dtype, preprocess=shift_batch)  # the old path
        groups = loader.batch_sampler.batches(0)
        batches = _received(loader)
        assert len(batches) == len(groups) >= 3
        assert any(len(g) > 1 for g in groups) if total > longest else any(len(g) == 1 for g in groups)
        for group, batch in zip(groups, batches, strict=True):
            wire = torch.float8_e4m3fn if stored == "fp8" else torch.bfloat16
            assert batch["hidden_states"].dtype == wire and batch["hidden_states"].shape == (1, total, 768)
            assert (stored == "fp8") == ("hidden_states_exp" in batch)
            assert batch["num_tokens"] == int((batch["document_ids"] != -1).sum())
            expected, got = before([data.decode(ds[i], dtype) for i in group]), data.decode(batch, dtype)
            assert set(got) == set(expected) | {"num_tokens"}
            for key, value in expected.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
                else:
                    assert got[key] == value, key


def _received(loader) -> list[dict]:
    """The loader's batches as the consumer received them (copies, a RingLoader's released)."""
    out = []
    for batch in loader:
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != data.RING_KEY})
        getattr(loader, "release", lambda _batch: None)(batch)
    return out


def _assert_batches_equal(got: dict, expected: dict) -> None:
    assert set(got) - {data.RING_KEY} == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("stored", ["bfloat16", "fp8"])
def test_reused_batch_buffers_wrap_many_times_and_a_held_batch_is_never_overwritten(gen_dir, tmp_path, stored):
    refs = _refs(gen_dir)[0] if stored == "bfloat16" else _fp8_copy(gen_dir, tmp_path)
    ds = data.ShardDataset(refs, num_aux=3, dtype=torch.bfloat16)
    total = max(r.num_tokens for r in refs)  # a small budget: many batches per epoch
    kwargs = dict(total_seq_len=total, hidden_size=256, world_size=1, rank=0, seed=0)
    plain = data.make_loader(ds, num_workers=0, **kwargs)
    ring = data.make_loader(ds, num_workers=2, prefetch_factor=2, reuse_buffers=True, **kwargs)
    assert isinstance(ring, data.RingLoader) and ring.ring.num_slots == 2 * 3 and len(ring) == len(plain)
    ring.ring.timeout_s = 30.0  # a worker waiting for a slot fails the test instead of hanging it
    for epoch in range(3):
        for loader in (plain, ring):
            loader.batch_sampler.set_epoch(epoch)
        expected = list(plain)
        assert len(expected) > 2 * ring.ring.num_slots  # every worker's slots wrap at least twice an epoch
        for i, (want, got) in enumerate(zip(expected, ring, strict=True)):
            if i % 3 == 0:  # held a while: the workers run ahead into every other slot meanwhile
                time.sleep(0.03)
            _assert_batches_equal(got, want)
            ring.release(got)
        if epoch == 1:  # an early stop: the batches the DataLoader drops are released by the next iteration
            for i, got in enumerate(ring):
                ring.release(got)
                if i == 2:
                    break
            ring.batch_sampler.set_epoch(epoch)
            assert len(_received(ring)) == len(expected)


def test_a_consumer_holding_a_batch_past_its_turn_gets_an_error_and_the_batch_stays_intact(gen_dir):
    refs, _ = _refs(gen_dir)
    ds = data.ShardDataset(refs, num_aux=3, dtype=torch.bfloat16)
    kwargs = dict(total_seq_len=max(r.num_tokens for r in refs), hidden_size=256, world_size=1, rank=0, seed=0)
    expected = list(data.make_loader(ds, num_workers=0, **kwargs))
    ring = data.make_loader(ds, num_workers=2, prefetch_factor=1, reuse_buffers=True, **kwargs)
    ring.ring.timeout_s = 1.0
    batches = iter(ring)
    held = next(batches)  # never released: the worker due to write its slot waits, then fails
    with pytest.raises(RuntimeError, match="must release each batch"):
        for got in batches:
            ring.release(got)
    _assert_batches_equal(held, expected[0])


def test_a_batch_buffer_is_written_only_after_the_batch_before_it_was_released():
    ring = data.BatchRing(2, 2, 256, timeout_s=0.2)  # 2 workers, 2 slots each
    first = ring.acquire(1, 0).take("x", (4,), torch.float32)
    first.fill_(7.0)
    ring.acquire(1, 1)
    ring.acquire(0, 0)  # the other worker's slots are its own
    with pytest.raises(RuntimeError, match="must release each batch"):
        ring.acquire(1, 2)  # worker 1's first slot still holds its batch 0
    assert torch.equal(ring.views(1, 0, [("x", torch.float32, (4,), 0)])["x"], torch.full((4,), 7.0))
    ring.release(1, 0)
    assert ring.acquire(1, 2).take("x", (4,), torch.float32).data_ptr() == first.data_ptr()
    ring.release(1, 1)
    assert ring.acquire(1, 3).take("y", (10**6,), torch.uint8) is None  # too big for a slot: a fresh buffer


def test_skipped_samples_are_counted_and_an_all_skipped_batch_is_speculators_empty_batch(gen_dir):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.recovery import SampleUnavailable

    refs, _ = _refs(gen_dir)
    ds = data.ShardDataset(refs, num_aux=3)
    collate = data.PackedCollate(128, 256, 3, torch.float32)
    before = CollateFn(128, 256, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)
    gone = SampleUnavailable(reason="gone")
    for items in ([ds[0], gone, ds[1]], [gone, gone]):
        got, expected = data.decode(collate(items), torch.float32), before(items)
        assert got["error_records"] == expected["error_records"] == items.count(gone)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value), key


@pytest.mark.parametrize("stored", ["bfloat16", "fp8"])
def test_the_loaders_capture_check_counts_what_the_generate_stage_check_counts(stored):
    hs = torch.randn(64, 4, 32)
    hs[3, 1, 7], hs[5, 2, :3], hs[9, 0] = float("nan"), float("nan"), 0
    hs[:, 3] = 0
    if stored == "bfloat16":
        hs[6, 0, 1], hs[8, 2, 2] = float("inf"), float("-inf")
    encoded = shard_format.encode_sample("k", hs, stored)
    q = encoded["k.hs"]
    reference = hs.to(torch.bfloat16) if stored == "bfloat16" else shard_format.dequantize_fp8(q, encoded["k.scale"])
    expected = capture_checks.capture_stats(reference)
    got = capture_checks.bad_row_counts(q)
    assert got["zero_rows"] == expected["zero_rows"] == [1, 0, 0, 64]
    assert got["nonfinite"] == expected["nonfinite"] and sum(got["nonfinite"]) >= 4
