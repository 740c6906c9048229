"""Which verifier layers are captured: the aux layer ids of EAGLE-3 plus the final layer.

Layer id k is the residual stream after k decoder layers (HF `hidden_states[k]`, the input of layer k); id L
(= num_hidden_layers) is the last layer's output before the final norm, the drafter's target. The ids resolved here
are written to capture.json and into the drafter's config: vLLM serving the drafter must capture the same ones.

    text = text_config(AutoConfig.from_pretrained(path))        # finds the LM config, however it is nested
    aux, final = resolve_layer_ids(text.num_hidden_layers, cfg.verifier.aux_layer_ids)
"""

from __future__ import annotations

from typing import Any

# Where multimodal / wrapper configs keep the language model's config (Llava, Qwen2.5-VL, Gemma3, InternVL, Kimi-VL,
# ...). Searched in order, recursively, until a config with `num_hidden_layers` is found.
NESTED_TEXT_CONFIG_KEYS = ("text_config", "language_model", "llm_config", "language_config", "text_model", "llm")


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def text_config(config: Any) -> Any:
    """The (possibly nested) language-model config that owns `num_hidden_layers`; a dict or a config object."""
    if _get(config, "num_hidden_layers") is not None:
        return config
    for key in NESTED_TEXT_CONFIG_KEYS:
        inner = _get(config, key)
        if inner is not None:
            try:
                return text_config(inner)
            except ValueError:
                continue
    keys = sorted(config.keys()) if isinstance(config, dict) else sorted(vars(config))
    raise ValueError(f"verifier config has no num_hidden_layers, at the top or under any of "
                     f"{list(NESTED_TEXT_CONFIG_KEYS)}; top-level keys: {keys}")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's (and speculators') choice: an early, a middle and a late layer."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(num_layers: int, aux_layer_ids: list[int] | None) -> tuple[list[int], int]:
    """(aux ids, final id L). Explicit ids are validated; defaults that collide for small L are an error."""
    if aux_layer_ids is None:
        ids = default_aux_layer_ids(num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 1 or max(ids) >= num_layers:
            raise ValueError(
                f"verifier.aux_layer_ids: the EAGLE-3 defaults [2, L//2, L-3] = {ids} are not distinct layers in "
                f"(0, {num_layers}) for a verifier with {num_layers} layers; set verifier.aux_layer_ids explicitly "
                f"(e.g. [1, {num_layers // 2}, {num_layers - 2}])")
        return ids, num_layers
    ids = list(aux_layer_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"verifier.aux_layer_ids must be unique, got {ids}")
    bad = [i for i in ids if not 0 < i < num_layers]
    if bad:
        raise ValueError(f"verifier.aux_layer_ids {bad} out of range: each id must satisfy 0 < id < {num_layers} "
                         f"(num_hidden_layers); the final layer {num_layers} is always captured on its own")
    return ids, num_layers
