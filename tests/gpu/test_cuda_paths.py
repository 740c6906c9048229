"""The CUDA variants of unit-tier checks: run on an H200 machine (`bash gpu_machine/run_checks.sh pytest_gpu`)."""

import pytest
import torch

from tests.support.device_checks import (
    drafter_loads_into_a_run_with_another_draft_vocabulary,
    planned_rows_cut_by_sample_are_each_samples_planned_capture,
    tiny_bench_run,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_steps_planned_rows_on_cuda_cut_by_sample_are_each_samples_planned_capture(dtype):
    planned_rows_cut_by_sample_are_each_samples_planned_capture("cuda", dtype)


def test_device_batches_on_cuda_equal_the_host_decode_and_survive_an_early_stop(tmp_path):
    from eagle3_ray.core import shard_format, shards
    from eagle3_ray.train import data
    from eagle3_ray.train import worker as train_worker

    gen_dir, _ = tiny_bench_run(tmp_path)
    refs, _ = data.load_refs(gen_dir)
    for ref in refs[:8]:  # half the samples stored as fp8: mixed batches fall back to the host decode
        path = str(tmp_path / f"{ref.key}.fp8.safetensors")
        shards.write_shard(
            path, shard_format.encode_sample(ref.key, shards.read_sample(ref.shard_path, ref.key), "fp8")
        )
        ref.shard_path = path
    kwargs = dict(total_seq_len=96, hidden_size=64, world_size=1, rank=0, seed=0, num_workers=2)
    loader = data.make_loader(data.ShardDataset(refs, 3, dtype=torch.bfloat16), **kwargs)
    ring = data.make_loader(data.ShardDataset(refs, 3, dtype=torch.bfloat16), reuse_buffers=True, **kwargs)
    # make_loaders' CUDA loader: one loader iteration through the epochs
    batches = train_worker.DeviceBatches(ring, torch.device("cuda"), torch.bfloat16, epochs=4)
    for epoch in range(4):
        loader.batch_sampler.set_epoch(epoch)
        ring.batch_sampler.set_epoch(epoch)
        host = [data.decode(b, torch.bfloat16) for b in loader]
        received = 0
        for i, got in enumerate(batches):
            received += 1
            for k, v in host[i].items():
                if isinstance(v, torch.Tensor):
                    assert got[k].is_cuda and torch.equal(got[k].cpu(), v), k
            if epoch == 0 and i == 2:
                break  # the producer thread stops; epoch 1 starts the loader afresh, epochs 2 and 3 follow on
        assert received == (3 if epoch == 0 else len(host))
    torch.cuda.synchronize()
    assert batches.num_copied >= 3 and batches.pin_s > 0


def test_a_drafter_loads_into_a_run_built_on_cuda(tiny_llama, tmp_path):
    """train.init_from where the run's drafter already sits on its GPU (the worker builds it there)."""
    drafter_loads_into_a_run_with_another_draft_vocabulary("cuda", tiny_llama, tmp_path)
