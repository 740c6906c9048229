"""The configs the tests run with, built with the library's `config_from_dict` (one place per kind of test run)."""

from __future__ import annotations

from eagle3_ray.core.config import Config, config_from_dict

# vLLM-CPU engines of the tests: no compile (about 40 s per start), a 256 MiB KV cache (the default check fails here)
CPU_ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}


def run_cfg(tmp_path, storage_path: str | None = None, **sections) -> Config:
    """A run named `r` under `storage_path` (default `tmp_path`) with the given sections."""
    return config_from_dict({"run": {"storage_path": storage_path or str(tmp_path), "name": "r"}, **sections})


def generate_cfg(tmp_path, verifier: str, dtype: str = "bfloat16", **generate) -> Config:
    """The generate stage on the tiny Llama: 16 tokens, small units and shards, aux layers [1, 3, 4]."""
    gen = {"max_tokens": 16, "max_batch_tokens": 256, "shard_max_bytes": 150_000, "engine_kwargs": CPU_ENGINE}
    return config_from_dict(
        {
            "run": {"storage_path": str(tmp_path), "name": "r", "num_cpus": 4},
            "verifier": {"path": verifier, "dtype": dtype, "aux_layer_ids": [1, 3, 4], "max_model_len": 1024},
            "generate": {**gen, **generate},
        }
    )


def online_cfg(tmp_path, verifier: str, name: str, **train) -> Config:
    """Online training on the tiny Llama: 2 workers, 2 epochs, engines streaming 32-token responses."""
    return config_from_dict(
        {
            "run": {"storage_path": str(tmp_path), "name": name},
            "verifier": {"path": verifier, "aux_layer_ids": [1, 3, 4], "max_model_len": 512},
            "generate": {
                "max_tokens": 32,
                "max_batch_tokens": 640,
                "engine_kwargs": {**CPU_ENGINE, "max_num_seqs": 16},
            },
            "train": {
                "source": "online",
                "num_workers": 2,
                "epochs": 2,
                "total_seq_len": 256,
                "draft_vocab_size": 512,
                "lr": 2e-3,
                "warmup_steps": 2,
                "log_every_steps": 2,
                "val_fraction": 0.2,
                "max_failures": 2,
                **train,
            },
        }
    )
