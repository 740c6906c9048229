"""Typed config: the shipped recipes load, overrides are typed, unknown keys and bad values name the field."""

from __future__ import annotations

import pytest

from eagle3_ray.core.config import Config, dump_config, load_config
from tests.support import REPO

pytestmark = pytest.mark.unit

CONFIGS = REPO / "ray_jobs" / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))


def test_the_shipped_recipes_are_the_eight_documented_ones():
    assert [p.stem for p in RECIPES] == [
        "kimi_k25",
        "llama3_8b",
        "qwen3_30b_a3b",
        "smollm2_cpu",
        "smollm2_h200",
        "smollm2_quick_cpu",
        "tiny_cpu",
        "tiny_kimi_cpu",
    ]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_round_trips_through_yaml(recipe, tmp_path):
    cfg = load_config(recipe)
    assert isinstance(cfg, Config)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(cfg))
    assert load_config(dumped) == cfg


@pytest.mark.parametrize(
    "recipe, path, aux, tp",
    [
        ("llama3_8b", "meta-llama/Llama-3.1-8B-Instruct", [2, 16, 29], 1),  # 32 layers
        ("qwen3_30b_a3b", "Qwen/Qwen3-30B-A3B", [2, 24, 45], 2),  # 48 layers
        ("kimi_k25", "moonshotai/Kimi-K2.5", [2, 30, 58], 8),  # 61 layers (text_config)
    ],
)
def test_real_model_recipes_carry_their_aux_layers_and_parallelism(recipe, path, aux, tp):
    cfg = load_config(CONFIGS / f"{recipe}.yaml")
    assert cfg.verifier.path == path and cfg.verifier.aux_layer_ids == aux
    assert cfg.generate.tensor_parallel_size == tp and cfg.generate.num_gpus_per_worker == 1 and cfg.train.use_gpu
    assert cfg.verifier.trust_remote_code == (recipe == "kimi_k25")


def test_tiny_cpu_recipe_is_the_embedded_default_with_small_numbers():
    cfg = load_config(CONFIGS / "tiny_cpu.yaml")
    assert cfg.verifier.path == "tiny:llama" and cfg.ingest.inputs == ["builtin:tiny_prompts"]
    assert cfg.generate.engine_kwargs["enforce_eager"] is True
    assert cfg.generate.engine_kwargs["kv_cache_memory_bytes"] == 256 << 20
    assert cfg.generate.max_tokens <= 64 and cfg.train.num_workers == 2 and cfg.evaluate.report_only


def test_the_quick_smollm2_recipe_trains_less_than_the_long_one_and_gates_one_request_at_a_time():
    quick, long = load_config(CONFIGS / "smollm2_quick_cpu.yaml"), load_config(CONFIGS / "smollm2_cpu.yaml")
    assert quick.verifier == long.verifier and quick.evaluate.prompts == long.evaluate.prompts == "builtin:mtbench"
    quick_tokens = quick.generate.max_tokens * quick.generate.responses_per_prompt * quick.train.epochs
    assert quick_tokens < long.generate.max_tokens * long.generate.responses_per_prompt * long.train.epochs
    assert quick.evaluate.concurrency == [1] and quick.evaluate.min_speedup == 1.0 and quick.evaluate.baseline_again
    assert quick.run.name != long.run.name


def test_overrides_apply_with_their_declared_types():
    cfg = load_config(
        CONFIGS / "tiny_cpu.yaml",
        [
            "train.epochs=5",
            "train.lr=1",
            "ingest.turns=all",
            "ingest.max_rows=null",
            "verifier.aux_layer_ids=[1, 2, 4]",
            "generate.engine_kwargs={enforce_eager: false}",
            "run.name=other",
        ],
    )
    assert cfg.train.epochs == 5 and isinstance(cfg.train.epochs, int)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.ingest.turns == "all" and cfg.ingest.max_rows is None
    assert cfg.verifier.aux_layer_ids == [1, 2, 4]
    assert cfg.generate.engine_kwargs == {"enforce_eager": False}
    assert cfg.run.name == "other"


@pytest.mark.parametrize("written, value", [("1e-3", 1e-3), ("2E-4", 2e-4), ("+1.5e2", 150.0)])
def test_a_float_in_exponent_notation_is_a_float(written, value):
    # YAML 1.1 (PyYAML) reads an exponent without a dot, 1e-3, as a string: a float field takes it as the number
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", [f"train.lr={written}"])
    assert cfg.train.lr == value and isinstance(cfg.train.lr, float)


def test_defaults_load_without_a_recipe():
    assert load_config() == Config()


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epoch=3", "unknown config key train.'epoch'; did you mean 'epochs'?"),
        ("ingest.max_prompt_token=10", "did you mean 'max_prompt_tokens'?"),
        ("trian.epochs=3", "unknown config key 'trian'; did you mean 'train'?"),
    ],
)
def test_unknown_key_names_it_and_suggests_the_closest(override, message):
    with pytest.raises(ValueError, match=message.replace("?", r"\?").replace(".", r"\.")):
        load_config(CONFIGS / "tiny_cpu.yaml", [override])


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.epochs=zero", "train.epochs"),
        ("train.epochs=0", "train.epochs"),
        ("train.epochs=true", "train.epochs"),
        ("train.epochs=1e3", "train.epochs"),
        ("train.lr=1e-3x", "train.lr"),
        ("train.compile=fast", "train.compile"),
        ("ingest.turns=some", "ingest.turns"),
        ("ingest.max_prompt_tokens=-1", "ingest.max_prompt_tokens"),
        ("ingest.num_workers=0", "ingest.num_workers"),
        ("ingest.inputs=[]", "ingest.inputs"),
        ("ingest.inputs=data.jsonl", "ingest.inputs"),
        ("verifier.aux_layer_ids=[2, 2, 5]", "verifier.aux_layer_ids"),
        ("generate.tensor_parallel_size=3", "generate.tensor_parallel_size"),
        ("generate.responses_per_prompt=0", "generate.responses_per_prompt"),
        ("generate.responses_per_prompt=2", "generate.responses_per_prompt"),  # greedy: the same answer twice
        ("run.name=a/b", "run.name"),
    ],
)
def test_bad_values_fail_naming_the_field(override, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('.', chr(92) + '.')}"):
        load_config(CONFIGS / "tiny_cpu.yaml", [override])


def test_two_pass_overlap_on_gpus_needs_a_fixed_kv_cache():
    gpu_overlap = ["generate.num_gpus_per_worker=1", "generate.two_pass_overlap=true", "generate.engine_kwargs={}"]
    with pytest.raises(ValueError, match=r"^generate\.two_pass_overlap: on GPUs needs .*kv_cache_memory_bytes"):
        load_config(CONFIGS / "tiny_cpu.yaml", gpu_overlap)
    fixed = load_config(
        CONFIGS / "tiny_cpu.yaml", [*gpu_overlap, "generate.engine_kwargs={kv_cache_memory_bytes: 1073741824}"]
    )
    assert fixed.generate.two_pass_overlap and fixed.generate.engine_kwargs["kv_cache_memory_bytes"] == 1 << 30
    assert load_config(CONFIGS / "tiny_cpu.yaml", ["generate.two_pass_overlap=true"]).generate.two_pass_overlap


def test_an_override_without_equals_sign_is_rejected():
    with pytest.raises(ValueError, match="must look like section.field=value"):
        load_config(None, ["train.epochs"])


def test_a_bad_override_on_the_command_line_is_one_error_line_without_a_traceback():
    import subprocess
    import sys

    root = REPO
    proc = subprocess.run(
        [sys.executable, "ray_jobs/pipeline.py", "ray_jobs/configs/tiny_cpu.yaml", "generate.writer_threads=0"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "generate.writer_threads" in proc.stderr and "must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
