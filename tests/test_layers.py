"""Aux layer ids: found in nested verifier configs, EAGLE-3 defaults, explicit ids validated."""

import pytest
from transformers import AutoConfig, LlamaConfig

from eagle3_ray.layers import resolve_layer_ids, text_config


def test_layer_count_is_found_in_nested_text_configs():
    llava = AutoConfig.for_model("llava", text_config={"model_type": "llama", "num_hidden_layers": 40})
    assert text_config(llava).num_hidden_layers == 40
    wrapped = {"architectures": ["X"], "llm_config": {"num_hidden_layers": 61, "hidden_size": 7168}}
    assert text_config(wrapped)["num_hidden_layers"] == 61
    deeper = {"language_model": {"text_config": {"num_hidden_layers": 28}}}
    assert text_config(deeper)["num_hidden_layers"] == 28
    assert text_config(LlamaConfig(num_hidden_layers=32)).num_hidden_layers == 32


def test_nested_config_resolves_eagle3_default_layer_ids():
    cfg = {"vision_config": {"num_hidden_layers": 27}, "text_config": {"num_hidden_layers": 32}}
    assert resolve_layer_ids(text_config(cfg)["num_hidden_layers"], None) == ([2, 16, 29], 32)


def test_config_without_layer_count_names_the_keys_searched():
    with pytest.raises(ValueError, match="no num_hidden_layers.*text_config"):
        text_config({"vision_config": {"hidden_size": 3}})


def test_colliding_defaults_for_a_small_verifier_ask_for_explicit_ids():
    with pytest.raises(ValueError, match="set verifier.aux_layer_ids"):
        resolve_layer_ids(6, None)


def test_explicit_layer_ids_are_validated_and_the_final_layer_kept_apart():
    assert resolve_layer_ids(6, [1, 3, 4]) == ([1, 3, 4], 6)
    with pytest.raises(ValueError, match="unique"):
        resolve_layer_ids(6, [1, 1, 4])
    with pytest.raises(ValueError, match="out of range"):
        resolve_layer_ids(6, [0, 3, 6])
