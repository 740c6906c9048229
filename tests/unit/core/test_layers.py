"""Aux layer ids: found in nested verifier configs, EAGLE-3 defaults, explicit ids validated."""

import pytest
from transformers import AutoConfig, LlamaConfig

from eagle3_ray.core.layers import resolve_layer_ids, text_config

pytestmark = pytest.mark.unit


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


def _kimi_k25_config(num_layers: int = 61):
    """Kimi-K2.5's config.json layout: the multimodal wrapper with a DeepSeek-V3 text config nested inside."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "model_type": "deepseek_v3",
            "num_hidden_layers": num_layers,
            "hidden_size": 7168,
            "num_attention_heads": 64,
            "vocab_size": 163840,
        },
        "vision_config": {"model_type": "kimi_k25_vision", "num_hidden_layers": 27, "hidden_size": 1152},
    }


def test_kimi_k25_wrapper_resolves_to_what_vllm_serves_as_its_text_model():
    from vllm.transformers_utils.config import get_hf_text_config

    as_dict = _kimi_k25_config()
    as_object = AutoConfig.for_model(**{k: v for k, v in as_dict.items() if k != "architectures"})
    served = get_hf_text_config(as_object)
    assert text_config(as_object) is served and served.model_type == "deepseek_v3"
    assert text_config(as_dict)["num_hidden_layers"] == served.num_hidden_layers == 61  # not the vision tower's 27
    assert resolve_layer_ids(text_config(as_dict)["num_hidden_layers"], None) == ([2, 30, 58], 61)


def test_capture_and_the_contract_check_read_the_same_text_config():
    from eagle3_ray.core import contract

    wrapped = _kimi_k25_config(num_layers=6)
    verifier = contract.text_config(wrapped)
    assert verifier["num_hidden_layers"] == text_config(wrapped)["num_hidden_layers"] == 6
    assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]  # what capture.json records
    flat = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096}
    assert contract.text_config(flat) == flat


def test_reference_states_are_layer_inputs_and_the_last_layer_output_before_the_final_norm(tiny_llama_fp32):
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_ray.core.layers import reference_hidden_states

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_fp32, dtype=torch.float32).eval()
    ids = torch.arange(10, 50)
    layers = model.config.num_hidden_layers
    ref = reference_hidden_states(model, ids, [1, 3, layers])  # shape: [T, 3, H]
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    assert ref.shape == (40, 3, model.config.hidden_size)
    torch.testing.assert_close(ref[:, 0], hs[1][0])
    torch.testing.assert_close(ref[:, 1], hs[3][0])
    # transformers' last hidden state is after the final norm; the capture contract's id L is before it
    torch.testing.assert_close(model.model.norm(ref[:, 2]), hs[layers][0])
