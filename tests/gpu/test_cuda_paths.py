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


def test_the_gpu_stacks_vllm_runs_an_eagle31_drafter_with_its_input_norms(tiny_llama, tmp_path_factory):
    """train.fc_norm on the vLLM the GPU stack pins: export picks the layout that vLLM reads fc_norm from (the compat
    layout on 0.24), and the engine builds the drafter with fc_norm, drafts and gets drafts accepted."""
    from vllm import LLM, SamplingParams

    from eagle3_ray.core import contract, storage
    from eagle3_ray.core.config import config_from_dict
    from eagle3_ray.core.prompts import tiny_prompts
    from eagle3_ray.train import export
    from tests.support.drafters import attach, cached_run

    run_dir = cached_run(
        tmp_path_factory, tiny_llama, "fc-norm", num_steps=100, num_epochs=2, train_fields={"fc_norm": True}
    )
    run = {"storage_path": str(run_dir.parent), "name": run_dir.name}
    cfg = attach(config_from_dict({"run": run, "verifier": {"path": tiny_llama}, "export": {"checkpoint": "last"}}))
    export.run(cfg)
    drafter = storage.latest(str(run_dir), "export")["speculators_dir"]
    config = storage.read_json(storage.join(drafter, "config.json"))
    assert config["fc_norm"] is True and config["norm_before_fc"] is False
    speculative = {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}
    llm = LLM(
        tiny_llama,
        speculative_config=speculative,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        disable_log_stats=False,
    )
    assert contract.vllm_drafter_flags(llm) == {flag: config[flag] for flag in contract.DRAFTER_FLAGS}
    conversations = [c["messages"] for c in tiny_prompts(split="eval", num_prompts=8)]  # what the drafter knows
    llm.chat(conversations, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    metrics = llm.get_metrics()
    accepted = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_accepted_tokens")
    drafts = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_draft_tokens")
    print(f"fc_norm drafter on CUDA: {accepted:.0f} of {drafts:.0f} draft tokens accepted")
    assert drafts > 0 and accepted > 0
