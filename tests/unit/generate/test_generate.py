"""The generate stage's parts without Ray or an engine: unit planning, engine arguments, capture checks and stats, the
connector's shard encoding, the writer threads, auto mode (the stage end to end: tests/e2e/test_generate.py)."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from eagle3_ray.core import capture_checks, shard_format, shard_writer, shards
from eagle3_ray.core.config import load_config
from tests.support import REPO
from tests.support.configs import generate_cfg
from tests.support.device_checks import planned_rows_cut_by_sample_are_each_samples_planned_capture

pytestmark = pytest.mark.unit


def test_planning_bounds_units_by_tokens_and_puts_an_oversized_sample_alone(tmp_path):
    from eagle3_ray.generate.plan import plan_units

    cfg = generate_cfg(tmp_path, "unused", max_batch_tokens=100, oversize="alone")
    rows = [{"id": f"s{i}", "messages": [], "source": "x"} for i in range(5)]
    units, rejects = plan_units(rows, [40, 40, 250, 30, 30], cfg)
    assert [[s["id"] for s in u.samples] for u in units] == [["s0", "s1"], ["s2"], ["s3", "s4"]]
    assert rejects == [] and len({u.unit_id for u in units}) == 3
    again, _ = plan_units(rows, [40, 40, 250, 30, 30], cfg)
    assert [u.unit_id for u in again] == [u.unit_id for u in units]


def test_extract_hidden_states_engines_schedule_synchronously_and_drop_vllms_drafts(tmp_path):
    """generate.capture_method=extract_hidden_states: async scheduling (vLLM's GPU default for EAGLE-type methods)
    shifts the method's captured rows against the saved tokens at every accepted draft and leaves the tail rows
    unwritten, so its engines schedule synchronously; they get NoDraftScheduler, which overrides the method vLLM's
    engine core hands each step's drafts to; `extract_hidden_states_draft_slot` and the plain engine keep vLLM's
    scheduler. If vLLM stops calling `update_draft_token_ids`, the override would silently do nothing: the last
    assert catches that."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from eagle3_ray.generate import engine
    from eagle3_ray.generate.scheduler import NoDraftScheduler

    cfg = generate_cfg(tmp_path, "unused", capture_method="extract_hidden_states")
    kwargs = engine.engine_kwargs(cfg, "m", [1, 3, 4, 6], "/s")
    assert kwargs["async_scheduling"] is False and kwargs["speculative_config"]["enforce_eager"] is True
    assert kwargs["scheduler_cls"] == engine.NO_DRAFT_SCHEDULER
    plain = engine.engine_kwargs(cfg, "m", [1, 3, 4, 6], "/s", capture=False)
    assert not {"async_scheduling", "scheduler_cls", "speculative_config"} & set(plain)
    with_slot = generate_cfg(tmp_path, "unused", capture_method="extract_hidden_states_draft_slot")
    slot = engine.engine_kwargs(with_slot, "m", [1, 3, 4, 6], "/s")
    assert "scheduler_cls" not in slot and slot["speculative_config"]["method"] == "extract_hidden_states"
    assert engine.NO_DRAFT_SCHEDULER == f"{NoDraftScheduler.__module__}.{NoDraftScheduler.__qualname__}"
    assert issubclass(NoDraftScheduler, Scheduler) and "update_draft_token_ids" in vars(NoDraftScheduler)
    assert "self.scheduler.update_draft_token_ids(" in inspect.getsource(EngineCore)


def test_the_forward_capture_method_loads_the_verifier_as_its_capture_model_in_a_plain_engine(tmp_path, monkeypatch):
    """generate.capture_method=forward (the default): no speculative method, no scheduler of ours, vLLM's own
    scheduling; the verifier's architectures become the capture model's (registered by the project's vLLM plugin,
    whose entry point the install provides) and the captured layer ids travel in hf_overrides, next to the user's.
    A VLLM_PLUGINS that leaves the plugin out is an error naming it, not an engine that captures nothing."""
    from importlib.metadata import entry_points

    from eagle3_ray.core.tiny_verifier import build_tiny_verifier
    from eagle3_ray.generate import capture_model, engine

    verifier = str(build_tiny_verifier("llama", tmp_path / "v"))
    cfg = generate_cfg(tmp_path, verifier, engine_kwargs={"hf_overrides": {"rope_theta": 5.0}})
    assert cfg.generate.capture_method == "forward"  # the default
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    kwargs = engine.engine_kwargs(cfg, verifier, [1, 3, 4, 6], "/s")
    assert not {"speculative_config", "scheduler_cls", "async_scheduling"} & set(kwargs)
    assert kwargs["hf_overrides"] == {
        "architectures": ["Eagle3RayCapture_LlamaForCausalLM"],
        capture_model.CAPTURE_LAYERS_KEY: [1, 3, 4, 6],
        "rope_theta": 5.0,
    }
    assert kwargs["kv_transfer_config"]["kv_connector"] == engine.CONNECTOR_NAME
    plain = engine.engine_kwargs(cfg, verifier, [1, 3, 4, 6], "/s", capture=False)
    assert plain["hf_overrides"] == {"rope_theta": 5.0} and "kv_transfer_config" not in plain
    (plugin,) = entry_points(group="vllm.general_plugins", name=capture_model.PLUGIN)
    assert plugin.load() is capture_model.register
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(ValueError, match="VLLM_PLUGINS='lora_filesystem_resolver' leaves out eagle3_ray_capture"):
        engine.engine_kwargs(cfg, verifier, [1, 3, 4, 6], "/s")


def test_the_capture_model_is_the_verifiers_vllm_class_with_the_capture_before_it():
    """capture_model's classes, as vLLM imports them by name: vLLM's class for the architecture, first in the MRO
    after the capture mixin (so vLLM's interfaces, weights and compile hooks are the verifier's); an unknown
    architecture is an AttributeError naming it."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from eagle3_ray.generate import capture_model

    cls = capture_model.Eagle3RayCapture_LlamaForCausalLM
    assert cls.__mro__[1:3] == (capture_model._CaptureMixin, LlamaForCausalLM)
    assert cls.__name__ == "Eagle3RayCapture_LlamaForCausalLM" and cls.__module__ == capture_model.__name__
    with pytest.raises(AttributeError, match="NoSuchForCausalLM"):
        _ = capture_model.Eagle3RayCapture_NoSuchForCausalLM


def test_a_steps_finished_samples_are_gathered_in_groups_of_bounded_rows(tmp_path):
    """The connector gathers a step's finished samples from the hidden-state cache in consecutive groups of at most
    generate.capture_gather_bytes of rows (one gather of every sample an 8B-shaped step finished ran an H100 out of
    memory); a sample larger than the bound is a group of its own; every sample once, in order."""
    from eagle3_ray.generate import engine
    from eagle3_ray.generate.connector import gather_groups

    groups = gather_groups([3, 4, 2, 10, 1, 1, 5], max_rows=7)
    assert [list(g) for g in groups] == [[0, 1], [2], [3], [4, 5, 6]]
    assert [list(g) for g in gather_groups([2, 2, 2], max_rows=100)] == [[0, 1, 2]]
    assert gather_groups([], max_rows=7) == []
    # (extract_hidden_states: its engine arguments need no verifier config, which "m" is not)
    cfg = generate_cfg(tmp_path, "unused", capture_gather_bytes=1 << 20, capture_method="extract_hidden_states")
    extra = engine.engine_kwargs(cfg, "m", [1, 3, 4, 6], "/s")["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["gather_bytes"] == 1 << 20


def test_a_unit_in_flight_in_as_many_dead_engines_as_allowed_fails_naming_it_and_the_error(tmp_path):
    """Ray retries a dead engine actor's units without end; a failure that repeats on the same work (an engine out of
    memory) must end the stage: each death counts an attempt for the units in flight, per pass (kind), and the
    unit's next try after generate.max_unit_attempts of them raises with the unit, its first sample and the error;
    the counts hold within one run of the stage."""
    from eagle3_ray.generate import commit

    out, samples = str(tmp_path), [{"id": "sharegpt-17"}, {"id": "sharegpt-18"}]
    commit.check_attempts(out, "generate", "u1", samples, max_attempts=2)  # never failed
    commit.record_failed_attempt(out, "generate", "u1", "EngineDeadError: first")
    commit.record_failed_attempt(out, "plain", "u1", "engine process 12 ended")  # the other pass's count
    commit.check_attempts(out, "generate", "u1", samples, max_attempts=2)
    commit.record_failed_attempt(out, "generate", "u1", "EngineDeadError: CUDA out of memory")
    with pytest.raises(RuntimeError, match=r"unit u1 \(2 samples, the first 'sharegpt-17'\) was in flight in 2 gen"):
        commit.check_attempts(out, "generate", "u1", samples, max_attempts=2)
    with pytest.raises(RuntimeError, match="max_unit_attempts=2\\); the last: EngineDeadError: CUDA out of memory"):
        commit.check_attempts(out, "generate", "u1", samples, max_attempts=2)
    commit.check_attempts(out, "plain", "u1", samples, max_attempts=2)
    commit.check_attempts(out, "generate", "u1", samples, max_attempts=3)
    commit.clear_attempts(out)  # what a new run of the stage does first: a resubmitted job starts afresh
    commit.check_attempts(out, "generate", "u1", samples, max_attempts=1)


def test_gpu_tensor_parallel_engines_use_the_ray_executor(tmp_path, monkeypatch):
    from eagle3_ray.generate import engine

    monkeypatch.setattr(engine, "_cpu_platform", lambda: False)  # the platform check is all that differs on a GPU
    cfg = generate_cfg(
        tmp_path, "unused", tensor_parallel_size=2, num_gpus_per_worker=1.0, capture_method="extract_hidden_states"
    )
    assert engine.engine_kwargs(cfg, "m", [1, 3, 4, 6], "/s")["distributed_executor_backend"] == "ray"


def test_cpu_thread_binding_gives_each_tensor_parallel_rank_its_own_cpus():
    from eagle3_ray.generate.engine import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3,4"
    assert cpu_thread_binding(4, [0, 1]) == "nobind"


def test_capture_check_fails_a_sample_with_nan_or_mostly_zero_rows_naming_sample_shard_and_layer(tmp_path):
    from eagle3_ray.generate.commit import CaptureCheckError, check_sample

    hs = torch.randn(10, 3, 8)  # shape: [T, L, H]
    hs[2:8, 1] = 0  # 6 of 10 token rows of layer 3 are all zero
    stats = capture_checks.capture_stats(hs)
    assert stats["zero_rows"] == [0, 6, 0] and stats["nonfinite"] == [0, 0, 0]
    record = {"id": "s1", "unit_id": "u1", "num_tokens": 10}
    cfg = generate_cfg(tmp_path, "unused")
    with pytest.raises(CaptureCheckError, match=r"sample s1 \(unit u1, shard u1-0000.safetensors\) layer 3: 6 of 10"):
        check_sample(cfg, record, stats, [1, 3, 6], "u1-0000.safetensors")
    check_sample(generate_cfg(tmp_path, "unused", max_zero_row_share=0.6), record, stats, [1, 3, 6], "x")  # allowed
    hs[0, 2, 5] = float("nan")
    with pytest.raises(CaptureCheckError, match="layer 6: 1 non-finite values"):
        check_sample(
            generate_cfg(tmp_path, "unused", max_zero_row_share=0.6),
            record,
            capture_checks.capture_stats(hs),
            [1, 3, 6],
            "x",
        )
    totals = capture_checks.aggregate_stats([capture_checks.capture_stats(hs)], [10], [1, 3, 6])
    assert totals["3"]["zero_row_share"] == 0.6 and totals["6"]["nonfinite"] == 1 and totals["1"]["norm_min"] > 0


def test_one_all_zero_row_fails_a_sample_at_the_default_zero_row_limit(tmp_path):
    """A real verifier's residual stream is never exactly zero: one row the engine never wrote (the tail rows an
    async-scheduled one-pass capture left as zeros) fails the sample by default, naming it."""
    from eagle3_ray.generate.commit import CaptureCheckError, check_sample

    hs = torch.randn(200, 3, 8)  # shape: [T, L, H]
    hs[-1] = 0  # the last token row, in every layer
    record = {"id": "s7", "unit_id": "u2", "num_tokens": 200}
    with pytest.raises(CaptureCheckError, match=r"sample s7 .* layer 1: 1 of 200 token rows are all zero"):
        check_sample(
            generate_cfg(tmp_path, "unused"), record, capture_checks.capture_stats(hs), [1, 3, 6], "u2-0000.safetensors"
        )
    hs[-1] = 1e-3
    check_sample(
        generate_cfg(tmp_path, "unused"), record, capture_checks.capture_stats(hs), [1, 3, 6], "u2-0000.safetensors"
    )


def test_capture_stats_in_row_chunks_equal_one_pass_over_the_whole_sample():
    """capture_stats walks a sample a few token rows at a time (NORM_CHUNK_VALUES): its numbers are those of one fp32
    norm over the whole sample, with zero rows, NaN and inf placed across chunk boundaries."""
    hs = (torch.randn(100, 4, 1024) * 3).to(torch.bfloat16)  # 7 token rows a chunk, 15 chunks
    hs[6:9, 2] = 0  # zero rows across the first chunk boundary
    hs[13, 0, 7], hs[14, 3, 1], hs[99, 1, 0] = float("nan"), float("inf"), float("-inf")
    norms = torch.linalg.vector_norm(hs, dim=-1, dtype=torch.float32)  # shape: [T, L]
    finite = torch.isfinite(norms)
    stats = capture_checks.capture_stats(hs)
    # several rows a chunk, many chunks
    assert math.prod(hs.shape[1:]) * 2 <= capture_checks.NORM_CHUNK_VALUES < hs.numel()
    assert stats["zero_rows"] == [0, 0, 3, 0] and stats["nonfinite"] == [1, 1, 0, 1]
    assert stats["norm_sum"] == torch.where(finite, norms, 0.0).double().sum(dim=0).tolist()
    assert stats["norm_min"] == torch.where(finite, norms, torch.inf).amin(dim=0).tolist()
    assert stats["norm_max"] == torch.where(finite, norms, -torch.inf).amax(dim=0).tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_steps_planned_rows_cut_by_sample_are_each_samples_planned_capture(dtype):
    planned_rows_cut_by_sample_are_each_samples_planned_capture("cpu", dtype)  # tests/gpu runs it on "cuda"


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "float32"])
def test_a_planned_shard_layout_is_what_the_connector_stores_and_a_streamed_shard_reads_back(tmp_path, dtype):
    """shard_format.sample_layout (a prefill unit's shards are planned from it before any capture) lists exactly the
    tensors shard_format.encode_sample stores; a InPlaceShard written sample by sample through the connector's own
    functions (planned_capture, write_planned_capture), out of order, is a safetensors file that holds them, read back
    by safetensors and by the training reader, and each sample's note holds its tokens and the stats of its capture;
    a tensor off its place is refused, and a writer late for an aborted shard writes nothing anywhere."""
    from eagle3_ray.train import data

    samples = {f"s{i}": torch.randn(t, 3, 16) for i, t in enumerate([7, 1, 5])}  # shape: [T, L, H]
    samples["s2"][1] = 0.0  # a zero row shows in its note's stats
    encoded = {k: shard_format.encode_sample(k, hs, dtype) for k, hs in samples.items()}
    layouts = {k: shard_format.sample_layout(k, hs.shape[0], 3, 16, dtype) for k, hs in samples.items()}
    for k, tensors in encoded.items():
        assert [(n, t.dtype, list(t.shape)) for n, t in tensors.items()] == layouts[k]
        assert shard_format.tensor_bytes(tensors) == shard_format.layout_bytes(layouts[k])
    uri = str(tmp_path / "shards" / "u-0000.safetensors")
    shard = shard_writer.InPlaceShard(uri, [e for k in samples for e in layouts[k]], metadata={"unit_id": "u"})
    shard.reserve()  # its payload's pages allocated before any write (generate.reserve_shard_pages)
    assert os.stat(shard.tmp).st_blocks * 512 >= shard.size - shard.payload_start
    with pytest.raises(ValueError, match="its place in the shard"):
        shard_writer.write_at(shard.tmp, {"s1.hs": encoded["s0"]["s0.hs"]}, shard.ranges(["s1.hs"]))  # s0's, at s1's
    for k in ["s2", "s0", "s1"]:  # the connector's threads finish in any order
        target = {"file": shard.tmp, "key": k, "dtype": dtype, "ranges": shard.ranges(encoded[k])}
        note = str(tmp_path / f"{k}.note")
        shard_writer.write_planned_capture(
            shard_writer.planned_capture(samples[k], target), torch.arange(len(samples[k])), target, note
        )
        got = shards.read_safetensors(note)
        assert torch.equal(got["token_ids"], torch.arange(len(samples[k])))
        stats = capture_checks.stats_from_norms(got["norms"], got["nonfinite"])
        assert stats == capture_checks.capture_stats(samples[k])
        assert stats["zero_rows"] == ([1, 1, 1] if k == "s2" else [0, 0, 0])
    assert not Path(uri).exists()  # only a finished shard has its final name
    assert shard.finish() == Path(uri).stat().st_size and not list(tmp_path.glob("shards/*.tmp-*"))
    with safe_open(uri, framework="pt") as f:
        assert f.metadata() == {"unit_id": "u"}
        assert {n: f.get_tensor(n) for n in f.keys()}.keys() == {n for t in encoded.values() for n in t}
        for tensors in encoded.values():
            for n, t in tensors.items():
                assert torch.equal(f.get_tensor(n).view(torch.uint8), t.view(torch.uint8)), n
    reader = data.ShardReader()
    for tensors in encoded.values():
        for n, t in tensors.items():
            assert torch.equal(reader.tensor(uri, n).view(torch.uint8), t.view(torch.uint8)), n
    aborted = shard_writer.InPlaceShard(str(tmp_path / "shards" / "u-0001.safetensors"), layouts["s1"])
    aborted.abort()
    assert sorted(p.name for p in tmp_path.glob("shards/*")) == ["u-0000.safetensors"]
    with pytest.raises(FileNotFoundError):
        shard_writer.write_at(aborted.tmp, encoded["s1"], {"s1.hs": [0, 96]})
    assert sorted(p.name for p in tmp_path.glob("shards/*")) == ["u-0000.safetensors"]


def test_the_connectors_host_arena_lends_pieces_that_never_overlap_and_merge_back_when_given_back():
    """shard_writer.HostArena, the connector's pinned copy target on GPU (here unpinned): pieces lent at once never
    share a byte, whatever order they come back in; a piece larger than every free range is refused (None: the connector
    then takes fresh pinned memory); once all are back the arena is one free range again."""
    import random

    page = shard_writer.HostArena.PAGE_BYTES
    arena = shard_writer.HostArena(64 * page, pin_memory=False)
    rng = random.Random(0)
    lent: dict[int, tuple[int, torch.Tensor]] = {}
    for _ in range(400):
        if lent and (rng.random() < 0.45 or len(lent) > 12):
            start = rng.choice(sorted(lent))
            num_bytes, piece = lent.pop(start)
            assert bool((piece == start % 251).all()), "another piece wrote into this one"
            arena.give(start, num_bytes)
            continue
        num_bytes = rng.randint(1, 9 * page)
        got = arena.take(num_bytes)
        if got is None:  # refused only when no free range holds it
            assert all(end - begin < num_bytes for begin, end in arena.free)
            continue
        start, piece = got
        assert piece.numel() == num_bytes and start % page == 0
        piece.fill_(start % 251)
        lent[start] = (num_bytes, piece)
    assert arena.take(65 * page) is None
    for start, (num_bytes, _) in list(lent.items()):
        arena.give(start, num_bytes)
    assert arena.free == [[0, 64 * page]]
    start, piece = arena.take(100)
    with pytest.raises(AssertionError, match="given back twice"):
        arena.give(start, 100), arena.give(start, 100)


def test_a_capture_file_read_whole_holds_what_the_connector_wrote(tmp_path):
    """shards.read_safetensors reads a connector file (safetensors' own save_file, as vLLM's connector writes it):
    the same tensors and dtypes; a cut-off file names itself."""
    from safetensors.torch import save_file

    big = {"hidden_states": torch.randn(9, 3, 16).to(torch.bfloat16), "token_ids": torch.arange(9)}
    save_file(big, str(tmp_path / "big.safetensors"))
    got = shards.read_safetensors(str(tmp_path / "big.safetensors"))
    assert got.keys() == big.keys()
    for k, t in big.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    data = (tmp_path / "big.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="cut.safetensors: .* payload bytes, the file ends there"):
        shards.read_safetensors(str(tmp_path / "cut.safetensors"))


def test_auto_mode_takes_the_cheaper_mode_by_the_engine_costs_of_the_nearest_measured_verifier(tmp_path, capsys):
    from eagle3_ray.generate.mode import resolve_mode
    from eagle3_ray.generate.plan import Unit

    sample = {"id": "a", "messages": [{"role": "user", "content": "hi"}], "source": "x"}
    llama_8b, smollm2, kimi = 4096 * 32, 576 * 30, 7168 * 61  # hidden size x layers

    def mode(num_samples: int, max_tokens: int, size: int = llama_8b, **generate) -> str:
        # 43 prompt tokens per sample: the builtin prompts' mean
        cfg = generate_cfg(tmp_path, "unused", mode="auto", max_tokens=max_tokens, **generate)
        return resolve_mode(cfg, [Unit("u", [sample] * num_samples, num_samples * (43 + max_tokens))], size)

    # CPU: capture during decode costs little against a plain decode, so one pass at any length
    assert mode(200, 256) == mode(10_000, 2048) == "generate"
    # GPU, 8B shape, the forward capture (the default): one pass at 0.85x plain costs less than two passes with a
    # second engine start, even for 9,460 ShareGPT-sized samples x 512 tokens; a larger verifier takes the 8B row
    gpu = {"num_gpus_per_worker": 1}
    assert mode(200, 256, **gpu) == mode(9_460, 512, **gpu) == mode(9_460, 512, kimi, **gpu) == "generate"
    # with vLLM's draft slot one pass decodes at 0.38x plain: 200 prompts x 256 tokens still do not pay for the
    # second start (the H200 bench's one-pass stage wall was the shorter one there); 9,460 x 512 do
    slot = {**gpu, "capture_method": "extract_hidden_states_draft_slot"}
    assert mode(200, 256, **slot) == "generate"
    assert mode(9_460, 512, **slot) == "two_pass"
    # the same work over 16 replicas: each replica's share no longer pays for its second start
    assert mode(9_460, 512, num_replicas=16, **slot) == "generate"
    # with the overlap the capture engine starts beside the plain pass: two passes whenever there is output
    overlap = {**slot, "two_pass_overlap": True, "engine_kwargs": {"kv_cache_memory_bytes": 1 << 30}}
    assert mode(1, 16, **overlap) == "two_pass"
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "auto_mode" in line and "mode=two_pass" in line and "costs=cuda" in line and "overlap=True" in line
    assert "capture_method=extract_hidden_states_draft_slot" in line and f"verifier_size={llama_8b}" in line
    # SmolLM2 on a GPU: the forward capture's one pass decodes at 0.56x plain and the capture prefill is 7x the 8B's,
    # so two passes win, one engine after the other too; the H200 recipe (overlap) on its 9,460 ShareGPT openers x 2
    # answers x 256 tokens: two_pass, the path measured at 0.98x plain vLLM on that model
    assert mode(9_460, 512, smollm2, **gpu) == "two_pass"
    assert "SmolLM2-135M" in capsys.readouterr().out
    recipe = load_config(REPO / "ray_jobs/configs/smollm2_h200.yaml")
    assert recipe.generate.responses_per_prompt == 2 and recipe.generate.max_tokens == 256
    assert resolve_mode(recipe, [Unit("u", [sample] * 18_920, 18_920 * (43 + 256))], smollm2) == "two_pass"
    # an auto run that left first-pass records goes on as two_pass, even where a fresh run would take one pass
    cpu = generate_cfg(tmp_path, "unused", mode="auto", max_tokens=256)
    assert resolve_mode(cpu, [Unit("u", [sample], 43 + 256)], 256 * 6, first_pass_done=3) == "two_pass"
    assert "resumed_first_pass_records=3" in capsys.readouterr().out
    assert resolve_mode(generate_cfg(tmp_path, "unused", mode="two_pass"), [], 256 * 6) == "two_pass"
    assert generate_cfg(tmp_path, "unused").generate.mode == "auto"  # the default


def test_byte_budget_holds_a_unit_back_until_earlier_captures_are_committed():
    import asyncio

    from eagle3_ray.generate.engine_loop import ByteBudget

    async def scenario() -> list[str]:
        budget, order = ByteBudget(100), []

        async def unit(name: str, num_bytes: int, hold_s: float) -> None:
            await budget.acquire(num_bytes, name)
            order.append(f"start {name}")
            await asyncio.sleep(hold_s)
            await budget.release(num_bytes)

        await asyncio.gather(unit("a", 60, 0.2), unit("b", 60, 0.0), unit("huge", 500, 0.0))
        return order

    order = asyncio.run(scenario())
    assert order[0] == "start a" and set(order[1:]) == {"start b", "start huge"}
    assert order.index("start huge") > 0  # larger than the budget: it runs, but alone


def test_the_connectors_shard_writes_run_one_at_a_time_per_file_and_side_by_side_across_files():
    """The connector's writer threads take a step's samples in unit order, each unit's into its own shards. A tmpfs
    write holds the file's inode lock, so in a plain FIFO pool every thread waited on the first unit's shard while
    the other units' samples queued: shard_writer.PerFileJobs runs one file's jobs in order, one at a time, and the
    other files' jobs beside them; a failed job fails only its own future."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()
    running: dict[str, int] = {}
    overlaps: list[str] = []
    order: list[str] = []
    hold_a = threading.Event()

    def job(path: str, name: str, fail: bool = False):
        def run():
            with lock:
                running[path] = running.get(path, 0) + 1
                if running[path] > 1:
                    overlaps.append(name)
                order.append(name)
            try:
                if name == "a0":
                    assert hold_a.wait(10)
                else:
                    time.sleep(0.01)
                if fail:
                    raise OSError(f"{name}: disk full")
                return name
            finally:
                with lock:
                    running[path] -= 1

        return run

    with ThreadPoolExecutor(4) as pool:
        jobs = shard_writer.PerFileJobs(pool)
        a = [jobs.submit("a", job("a", f"a{i}", fail=i == 1)) for i in range(4)]
        b = [jobs.submit("b", job("b", f"b{i}")) for i in range(4)]
        # file a's first job holds its file: b's jobs all finish meanwhile, a's others wait for it
        assert [f.result(timeout=10) for f in b] == ["b0", "b1", "b2", "b3"]
        assert not any(f.done() for f in a[1:])
        hold_a.set()
        assert a[0].result(timeout=10) == "a0"
        with pytest.raises(OSError, match="a1: disk full"):
            a[1].result(timeout=10)
        assert [f.result(timeout=10) for f in a[2:]] == ["a2", "a3"]
    assert overlaps == []
    assert [n for n in order if n.startswith("a")] == ["a0", "a1", "a2", "a3"]
    assert [n for n in order if n.startswith("b")] == ["b0", "b1", "b2", "b3"]
    with pytest.raises(RuntimeError, match="shutdown"):  # the pool is shut down: the caller hears it at once
        jobs.submit("c", job("c", "c0"))


def test_capture_only_requests_send_the_planners_ids_and_the_writer_completes_the_loss_mask(tmp_path, tiny_llama):
    """capture_only: the planner tokenizes each conversation once (its cost); the engine actor's request sends
    exactly those ids without templating anything, and the record's loss mask, filled in by a writer thread while the
    requests run, is the assistant spans' mask with counts that add up."""
    from eagle3_ray.generate import chat, commit, plan

    cfg = generate_cfg(tmp_path, tiny_llama, mode="capture_only")
    encoder = plan.chat_encoder(tiny_llama, cfg)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    rows = plan.with_prefill_ids([{"id": "a", "source": "t", "messages": messages}], cfg, encoder)
    units, rejects = plan.plan_units(rows, [plan.sample_cost(r, cfg, encoder) for r in rows], cfg)
    ids = encoder.encode(messages, False)
    sample = units[0].samples[0]
    assert not rejects and sample["input_ids"] == ids and units[0].num_tokens == len(ids)

    class Counting(chat.ChatEncoder):
        calls = 0

        def encode(self, *args):
            Counting.calls += 1
            return super().encode(*args)

    conv = chat.Conversation(sample, Counting(encoder.tokenizer, None), cfg, str(tmp_path), "u", "prefill")
    _, prompt, params = conv.start()
    assert prompt["prompt_token_ids"] == ids and params.max_tokens == 1 and Counting.calls == 0
    assert conv.record["loss_mask"] is None  # not on the engine's path
    commit.CaptureWriter("bfloat16", num_threads=1).complete([conv])  # what the actor queues as the requests go out
    deadline = time.monotonic() + 30
    while "num_prompt_tokens" not in conv.record:  # done by the writer thread, before any capture is ready
        assert time.monotonic() < deadline, "the writer did not complete the record"
        time.sleep(0.01)
    mask, r = conv.record["loss_mask"], conv.record
    assert mask == chat.loss_mask(encoder.assistant_spans(messages), len(ids)) and 0 < sum(mask) < len(ids)
    assert r["num_response_tokens"] == sum(mask) and r["num_prompt_tokens"] + sum(mask) == len(ids)
    assert r["finish_reason"] == "capture_only" and r["_num_captured"] == len(ids)  # T = n


class _Conv:
    """What commit.CaptureWriter and ShardPlan read of a chat.Conversation whose request has finished."""

    def __init__(self, sample_id: str, capture_path: str, num_tokens: int):
        self.record = {
            "id": sample_id,
            "unit_id": "u",
            "status": "ok",
            "input_ids": list(range(num_tokens)),
            "_num_captured": num_tokens,
        }
        self.capture_path, self.prepared, self.prepare_lock = capture_path, None, threading.Lock()
        self.shard, self.timing, self.capture_target = None, {}, {}
        self.transfer_params = {"hidden_states_path": capture_path, "include_output_tokens": False}

    def complete_record(self) -> None:
        pass  # the record holds all it commits with


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("reserve", [False, True])
def test_a_generate_units_samples_get_their_shard_places_as_they_finish(tmp_path, dtype, bad, reserve):
    """A generate unit through the actor's real writer threads: its open shards exist before any request, each
    finished sample gets the next free bytes of the emptiest one where vLLM's connector places it
    (shard_writer.stream_target, in the order requests finish, T known only then) and is written there as the connector
    writes it; the commit writes each shard's header from the places: every shard is a safetensors file holding
    exactly its samples' stored tensors, within a sample of shard_max_bytes, read back by the training reader, an
    unused shard is removed and the part file's rows name their shards. A sample failing the capture check fails
    the commit and no temp or partial shard remains. With generate.reserve_shard_pages each open shard's share of
    the unit's token budget is allocated on a background thread first, and the shards still end where their
    samples do."""
    import asyncio
    import random

    from eagle3_ray.generate import commit
    from eagle3_ray.train import data

    lengths = [9, 3, 7, 1, 5, 8]
    row_bytes = 4 * 16 * (1 if dtype == "fp8" else 2) + (4 if dtype == "fp8" else 0)  # one token's stored bytes
    cfg = generate_cfg(
        tmp_path,
        "unused",
        shard_max_bytes=30 * row_bytes,
        writer_threads=3,
        hidden_states_dtype=dtype,
        reserve_shard_pages=reserve,
    )
    sink = commit.ShardSink(cfg, str(tmp_path / "gen"), [1, 3, 4, 6])
    hidden = {f"s{i}": torch.randn(t, 4, 16).to(torch.bfloat16) for i, t in enumerate(lengths)}  # shape: [T, L, H]
    if bad:
        hidden["s3"][:, 2] = float("nan")
    convs = [_Conv(k, str(tmp_path / "scratch" / f"{k}.safetensors"), len(hs)) for k, hs in hidden.items()]
    stream = commit.FinishOrderShards(sink, "u", convs, hidden_size=16, num_tokens=4 * 30)  # the unit's token budget
    shards_dir = tmp_path / "gen" / "shards"
    assert len(list(shards_dir.glob("u-000?.safetensors.tmp-*"))) == 4 == len(stream.names)  # before any request
    for f in stream.files:
        f._wait_reserved()
        reserved = -(-4 * 30 * row_bytes // 4) if reserve else 0  # the budget's share of each shard
        assert os.stat(f.tmp).st_size == f.payload_start + reserved
        assert os.stat(f.tmp).st_blocks * 512 >= reserved
    used: dict[str, int] = {}  # the connector's (scheduler side)
    finish_order = random.Random(0).sample(convs, len(convs))
    for c in finish_order:  # what vLLM's connector does when each request finishes (eagle3_ray/generate/connector.py)
        request = c.capture_target["stream"]
        assert request["key"] == c.record["id"] and request["dtype"] == dtype
        target = shard_writer.stream_target(request, len(hidden[c.record["id"]]), used)
        os.makedirs(os.path.dirname(c.capture_path), exist_ok=True)
        shard_writer.write_planned_capture(
            shard_writer.planned_capture(hidden[target["key"]], target),
            torch.arange(len(hidden[target["key"]])),
            target,
            c.capture_path,
        )
        Path(c.capture_path + ".lock").touch()  # the connector's lock file, released: the capture is complete
    writer = commit.CaptureWriter(dtype, num_threads=3)

    async def run_unit():
        for c in finish_order:
            writer.prepare(c)
        return await writer.commit("u", convs, sink)

    if bad:
        with pytest.raises(commit.CaptureCheckError, match="sample s3"):
            asyncio.run(run_unit())
        assert not list(shards_dir.iterdir()) and not Path(sink.part_uri("u")).exists()
        return
    rows = asyncio.run(run_unit())
    names = sorted(p.name for p in shards_dir.iterdir())
    assert names == ["u-0000.safetensors", "u-0001.safetensors", "u-0002.safetensors", "u-0003.safetensors"]
    assert sum(r["num_bytes"] for r in rows) == sum(p.stat().st_size for p in shards_dir.iterdir())
    part = pq.read_table(sink.part_uri("u")).to_pylist()
    assert sorted(r["id"] for r in part) == sorted(hidden) and all(r["status"] == "ok" for r in part)
    reader = data.ShardReader()
    for name in names:
        held = [r for r in part if r["shard"] == name]
        with safe_open(str(shards_dir / name), framework="pt") as f:
            assert sorted(f.keys()) == sorted(
                n for r in held for n in shard_format.encode_sample(r["id"], hidden[r["id"]], dtype)
            )
        payload = sum(r["num_tokens"] for r in held) * row_bytes
        assert payload <= cfg.generate.shard_max_bytes + max(lengths) * row_bytes
        for r in held:
            want = shard_format.encode_sample(r["id"], hidden[r["id"]], dtype)
            for n, t in want.items():
                assert torch.equal(reader.tensor(str(shards_dir / name), n).view(torch.uint8), t.view(torch.uint8))
            assert r["num_tokens"] == len(hidden[r["id"]]) and r["key"] == r["id"] and r["hidden_size"] == 16
            assert r["dtype"] == ("float8_e4m3fn" if dtype == "fp8" else "bfloat16") and len(r["hs_norm_sum"]) == 4
    assert all(c.prepared == () for c in convs)  # the writer let go of every sample's stats


def test_an_open_shard_that_no_sample_reached_is_removed_and_a_gap_fails_the_unit(tmp_path):
    """FinishOrderShards: a shard the connector gave no sample (a conversation rejected before its final turn) is
    removed at the commit; a shard whose places leave a gap (a sample placed there whose note never came) fails the
    unit, naming the shard and the sample after the gap, and nothing of it stays."""
    from eagle3_ray.generate import commit

    cfg = generate_cfg(tmp_path, "unused", shard_max_bytes=1 << 20)
    sink = commit.ShardSink(cfg, str(tmp_path / "gen"), [1, 3])
    shards_dir = tmp_path / "gen" / "shards"

    def finish(stream, conv, used):  # the connector's part (scheduler side, then worker side)
        target = shard_writer.stream_target(conv.capture_target["stream"], 4, used)
        os.makedirs(os.path.dirname(conv.capture_path), exist_ok=True)
        shard_writer.write_planned_capture(
            shard_writer.planned_capture(torch.randn(4, 2, 8), target), torch.arange(4), target, conv.capture_path
        )
        conv.record["num_tokens"] = 4
        conv.prepared = (capture_checks.capture_stats(torch.randn(4, 2, 8)), None)
        stream.prepared(None, conv, shards.read_safetensors(conv.capture_path))

    convs = [_Conv(f"s{i}", str(tmp_path / "u0" / f"s{i}.safetensors"), 4) for i in range(3)]
    stream = commit.FinishOrderShards(sink, "u0", convs, hidden_size=8, num_tokens=8 << 20)
    assert len(stream.names) == 3  # the budget would fill 8 shards; one a sample at most
    used: dict[str, int] = {}
    for c in convs[:2]:  # s2 never reaches its final turn
        finish(stream, c, used)
    assert list(stream.shard_bytes()) == ["u0-0000.safetensors", "u0-0001.safetensors"]
    assert sorted(p.name for p in shards_dir.iterdir()) == ["u0-0000.safetensors", "u0-0001.safetensors"]

    convs = [_Conv(f"s{i}", str(tmp_path / "u1" / f"s{i}.safetensors"), 4) for i in range(2)]
    stream = commit.FinishOrderShards(sink, "u1", convs, hidden_size=8, num_tokens=8 << 20)
    used = {stream.files[1].tmp: 1 << 30}  # every sample goes to the first shard
    shard_writer.stream_target({**convs[0].capture_target["stream"], "key": "lost"}, 4, used)  # its note never comes
    for c in convs:
        finish(stream, c, used)
    with pytest.raises(
        RuntimeError,
        match="shard u1-0000.safetensors: sample s0 is at payload byte 128, the samples before it end at 0",
    ):
        stream.shard_bytes()
    stream.abort()
    assert sorted(p.name for p in shards_dir.iterdir()) == ["u0-0000.safetensors", "u0-0001.safetensors"]


@pytest.mark.parametrize("bad", [False, True])
def test_planned_shards_are_written_sample_by_sample_and_a_failed_unit_leaves_no_partial_shard(tmp_path, bad):
    """A prefill unit through the actor's real writer threads, its samples written into their planned shards as
    vLLM's connector writes them (each request carries its place): each planned shard exists before any capture,
    holds exactly its samples once they are checked, and its samples' rows name it; a sample failing the capture
    check (seen in the connector's note) fails the unit's commit, and no temp or partial shard remains."""
    import asyncio

    from eagle3_ray.generate import commit

    cfg = generate_cfg(tmp_path, "unused", shard_max_bytes=2 * 6 * 4 * 16 * 2, writer_threads=3)  # 2 samples a shard
    sink = commit.ShardSink(cfg, str(tmp_path / "gen"), [1, 3, 4, 6])
    hidden = {f"s{i}": torch.randn(6, 4, 16).to(torch.bfloat16) for i in range(5)}  # shape: [T, L, H]
    if bad:
        hidden["s3"][:, 1] = float("nan")
    convs = []
    for k in hidden:
        convs.append(_Conv(k, str(tmp_path / "scratch" / f"{k}.safetensors"), 6))
    plan = commit.ShardPlan(sink, "u", convs, hidden_size=16)
    assert [[c.record["id"] for c in g] for g in plan.groups] == [["s0", "s3"], ["s1", "s4"], ["s2"]]  # round-robin
    assert len(list((tmp_path / "gen" / "shards").glob("u-000?.safetensors.tmp-*"))) == 3  # before any capture
    for c in convs:  # what vLLM's connector does with each request's target (eagle3_ray/generate/connector.py)
        target = c.transfer_params["shard"]
        assert target["key"] == c.record["id"] and target["dtype"] == "bfloat16"
        os.makedirs(os.path.dirname(c.capture_path), exist_ok=True)
        shard_writer.write_planned_capture(
            shard_writer.planned_capture(hidden[target["key"]], target), torch.arange(6), target, c.capture_path
        )
        Path(c.capture_path + ".lock").touch()  # the connector's lock file, released: the capture is complete
    writer = commit.CaptureWriter("bfloat16", num_threads=3)

    async def run_unit():
        for c in convs:
            writer.prepare(c)
        return await writer.commit("u", convs, sink)

    shards_dir = tmp_path / "gen" / "shards"
    if bad:
        with pytest.raises(commit.CaptureCheckError, match="sample s3"):
            asyncio.run(run_unit())
        assert not list(shards_dir.glob("*.tmp-*")) and not (shards_dir / "u-0001.safetensors").exists()
        assert not Path(sink.part_uri("u")).exists()
        return
    rows = asyncio.run(run_unit())
    assert sorted(p.name for p in shards_dir.iterdir()) == [
        "u-0000.safetensors",
        "u-0001.safetensors",
        "u-0002.safetensors",
    ]
    assert sum(r["num_bytes"] for r in rows) == sum(p.stat().st_size for p in shards_dir.iterdir())
    part = pq.read_table(sink.part_uri("u")).to_pylist()
    assert [r["shard"] for r in part] == [f"u-000{j}.safetensors" for j in (0, 1, 2, 0, 1)]
    for r in part:
        with safe_open(str(shards_dir / r["shard"]), framework="pt") as f:
            assert torch.equal(f.get_tensor(f"{r['id']}.hs"), hidden[r["id"]]) and r["num_tokens"] == 6
            assert r["hidden_size"] == 16 and r["dtype"] == "bfloat16" and len(r["hs_norm_sum"]) == 4
    assert all(c.prepared == () for c in convs)  # the writer let go of every sample's tensors


def test_the_capture_budget_is_the_configured_bytes_or_sized_from_this_node(tmp_path):
    import psutil

    from eagle3_ray.generate import engine

    assert engine.capture_budget(generate_cfg(tmp_path, "unused", capture_buffer_bytes=3 << 30))[0] == 3 << 30
    budget, chosen = engine.capture_budget(generate_cfg(tmp_path, "unused"))
    assert chosen["source"] == "node" and chosen["node_gpus"] >= 1
    expected = chosen["available_bytes"] // 4 // chosen["node_gpus"]
    if chosen["shm_free_bytes"]:
        expected = min(expected, chosen["shm_free_bytes"] // 2)
    assert budget == max(expected, 1 << 30)
    assert chosen["available_bytes"] <= psutil.virtual_memory().total


def test_evaluate_engines_of_an_mla_verifier_on_a_cpu_without_amx_serve_mla_non_absorbed(tmp_path, monkeypatch):
    """vLLM-CPU's CPU_MLA (no AMX) and the drafter's attention share no KV block size: each evaluate engine actor then
    sets VLLM_MLA_DISABLE=1 for itself; not for a non-MLA verifier, not with AMX, not over the user's own setting."""
    import torch

    from eagle3_ray.core.tiny_verifier import _model_config
    from eagle3_ray.generate.engine import drafter_attention_env

    mla, llama = tmp_path / "mla", tmp_path / "llama"
    _model_config("deepseek_v3", 4096, 2).save_pretrained(mla)
    _model_config("llama", 4096, 2).save_pretrained(llama)
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert drafter_attention_env(str(mla), False) == {"VLLM_MLA_DISABLE": "1"}
    assert drafter_attention_env(str(llama), False) == {}
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert drafter_attention_env(str(mla), False) == {}
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "0")
    assert drafter_attention_env(str(mla), False) == {}


def test_a_prompts_first_response_is_greedy_and_its_copies_are_sampled(tmp_path, tiny_llama):
    """generate.responses_per_prompt > 1: the first response of each prompt is decoded greedily (what greedy serving
    decodes, and what training validates on), the copies `<id>#<k>` at `temperature` with their own seeds; with one
    response per prompt, `temperature` applies to it."""
    import pyarrow as pa

    from eagle3_ray.generate import chat, plan

    messages = [{"role": "user", "content": "Name a colour."}]
    table = pa.table({"id": ["p"], "source": ["t"], "messages": [messages]})

    def params(cfg):
        encoder = plan.chat_encoder(tiny_llama, cfg)
        out = {}
        for sample in plan.with_responses(table, cfg).to_pylist():
            _, _, p = chat.Conversation(sample, encoder, cfg, str(tmp_path), "u", "plain").start()
            out[sample["id"]] = (p.temperature, p.seed)
        return out

    several = params(generate_cfg(tmp_path, tiny_llama, responses_per_prompt=3, temperature=0.7))
    assert [t for t, _ in several.values()] == [0.0, 0.7, 0.7] and list(several) == ["p", "p#1", "p#2"]
    assert several["p#1"][1] != several["p#2"][1]
    assert params(generate_cfg(tmp_path, tiny_llama, temperature=0.7))["p"][0] == 0.7
    assert params(generate_cfg(tmp_path, tiny_llama))["p"][0] == 0.0
