"""The CPU-checkable parts of the GPU tooling in bench/gpu: the real-shaped verifier builder and the reference that
captured hidden states are checked against on the GPU machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu.check_capture import bad_tokens
from bench.gpu.make_verifier import build, model_config, weight_shapes
from eagle3_ray.core.layers import reference_hidden_states
from tests.support import REPO

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    # vocab 8192 with a 4096-id tokenizer: the same mismatch as the 8B-shaped verifier (128256 vs 4096)
    return Path(build("tiny", tmp_path_factory.mktemp("verifier") / "tiny", weights=True)["path"])


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def test_llama3_8b_preset_has_the_real_shape_and_parameter_count(tmp_path):
    cfg = model_config("llama3-8b", None, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    num_params = sum(s.numel() for s in weight_shapes(tmp_path).values())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (4096, 32, 128256)
    assert num_params == 8_030_261_248  # Llama-3.1-8B


def test_moe_preset_refuses_random_weights_whose_names_vllm_would_not_load(tmp_path):
    with pytest.raises(ValueError, match="no-weights"):
        build("qwen3-30b-a3b", tmp_path / "moe", weights=True)


def test_greedy_decoding_of_a_built_verifier_stays_inside_its_small_tokenizer(tiny_dir, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tokenizer) == 4096 and tiny_model.config.vocab_size == 8192
    ids = torch.tensor([tokenizer.encode("def parse(line):\n    return")])
    out = tiny_model.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert int(out.max()) < len(tokenizer)
    assert bool((tiny_model.lm_head.weight[len(tokenizer) :] == 0).all())


def test_capture_check_names_the_tokens_that_hold_another_positions_state(tiny_model):
    ref = reference_hidden_states(tiny_model, torch.arange(10, 74), [1, 3])  # [64, 2, H]
    stored = ref.clone()
    stored[48:64] = ref[16:32]  # the last block holds an earlier block's states (what a reused block would show)
    stored[5] += 1e-3 * ref[5]  # rounding-sized noise is not flagged
    found = bad_tokens(stored, ref)
    assert found["count"] == 16 and (found["first"], found["last"]) == (48, 63)
    assert found["best_match_offsets"] == [-32] * 16 and max(found["best_match_rel_error"]) < 1e-4
    assert bad_tokens(ref, ref) == {"count": 0}


def test_cpu_shares_name_processes_by_what_they_are_not_by_what_they_run_now():
    from bench.gpu.cpu_shares import process_name

    assert (
        process_name(["ray::MapWorker(MapBatches(EngineActor)).submit"], "ray::MapWorker(")
        == "ray::MapWorker(MapBatches(EngineActor))"
    )
    assert process_name(["ray::ActorLocationTracker.get_actor_locations"], "x") == "ray::ActorLocationTracker"
    assert process_name(["ray::_StatsActor      "], "x") == "ray::_StatsActor"
    assert process_name(["VLLM::EngineCore        "], "x") == "VLLM::EngineCore"
    assert (
        process_name(["/venv/bin/python3", "-u", "/site/ray/_private/log_monitor.py", "--x"], "x") == "log_monitor.py"
    )
    assert (
        process_name(["/venv/bin/python", "-B", "-c", "from multiprocessing.spawn import spawn_main"], "x")
        == "python -c"
    )
    assert process_name(["/venv/bin/python", "-m", "pytest", "-q"], "x") == "python -m pytest"
    assert process_name(["/site/ray/core/src/ray/raylet/raylet", "--flag"], "raylet") == "raylet"
    assert process_name([], "kworker/0:1") == "kworker/0:1"


def test_cpu_shares_average_cores_per_name_over_the_window_and_count_late_starters_from_zero():
    from bench.gpu.cpu_shares import cores

    snapshots = [
        (9.0, {1: ("driver", 0.5)}),  # before the window
        (10.0, {1: ("driver", 1.0), 2: ("VLLM::Worker", 5.0), 3: ("ray::A", 1.0), 4: ("ray::A", 2.0)}),
        (
            12.0,
            {1: ("driver", 1.2), 2: ("VLLM::Worker", 8.0), 3: ("ray::A", 1.2), 4: ("ray::A", 2.2), 5: ("late", 0.4)},
        ),
        (
            14.0,
            {1: ("driver", 1.4), 2: ("VLLM::Worker", 11.0), 3: ("ray::A", 1.4), 4: ("ray::A", 2.4), 5: ("late", 1.0)},
        ),
        (15.0, {1: ("driver", 9.0)}),  # after it
    ]
    got = cores(snapshots, 10.0, 14.5, top=3)
    assert got == {
        "window_s": 4.0,
        "total": (0.4 + 6.0 + 0.8 + 1.0) / 4,
        "VLLM::Worker": 1.5,
        "late": 0.25,
        "ray::A": 0.2,
    }
    assert cores(snapshots, 10.0, 11.0) == {}


def test_cpu_sampler_sees_a_busy_child_process_by_its_name(tmp_path):
    import subprocess
    import time

    from bench.gpu.cpu_shares import CpuSampler

    script = tmp_path / "spin.py"
    script.write_text("while True:\n    pass\n")
    sampler = CpuSampler(interval_s=0.2)
    child = subprocess.Popen([sys.executable, str(script)])
    try:  # the window lies inside the child's life, so every sample in it sees the child running
        time.sleep(0.3)
        start = time.time()
        time.sleep(1.2)
        got = sampler.cores(start, time.time())
    finally:
        child.kill()
        child.wait()
    assert got["spin.py"] > 0.2 and got["total"] >= got["spin.py"]


def test_generate_bench_set_overrides_its_own_config_and_a_recipes(tmp_path, monkeypatch):
    """`--set` reaches every row's config, with or without `--recipe` (the 8B shape runs without one); the row still
    sets mode and output length, and fails at its engine's first death."""
    from bench.gpu.generate_bench import make_cfg, parse_args

    for recipe in ([], ["--recipe", str(REPO / "ray_jobs/configs/smollm2_cpu.yaml")]):
        argv = ["generate_bench.py", "m", "--tiny", *recipe, "--set", "generate.capture_method=extract_hidden_states"]
        monkeypatch.setattr(sys, "argv", [*argv, "--set", "generate.writer_threads=3"])
        cfg = make_cfg(parse_args(), str(tmp_path), "two_pass_overlap", 48)
        gen = cfg.generate
        assert (gen.capture_method, gen.writer_threads) == ("extract_hidden_states", 3), recipe
        assert (gen.mode, gen.two_pass_overlap, gen.max_tokens, gen.ignore_eos) == ("two_pass", True, 48, True)
        assert gen.max_unit_attempts == 1  # a row fails at its engine's first death, the bench goes on
        assert cfg.verifier.path == "m"
        forward = make_cfg(parse_args(), str(tmp_path), "generate@forward", 48)
        assert (forward.generate.mode, forward.generate.capture_method) == ("generate", "forward")
        assert forward.run.name == "generate-forward-48"
