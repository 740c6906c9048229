"""Which verifier layers are captured: the aux layer ids of EAGLE-3 plus the final layer.

Layer id k is the residual stream after k decoder layers (HF `hidden_states[k]`, the input of layer k); id L
(= num_hidden_layers) is the last layer's output before the final norm, the drafter's target. The ids resolved here
are written to capture.json and into the drafter's config: vLLM serving the drafter must capture the same ones.

    text = text_config(AutoConfig.from_pretrained(path))        # finds the LM config, however it is nested
    aux, final = resolve_layer_ids(text.num_hidden_layers, cfg.verifier.aux_layer_ids)
"""

from __future__ import annotations

from typing import Any

# The keys transformers' `PreTrainedConfig.get_text_config()` looks under, which is what vLLM's
# `get_hf_text_config` returns for a config object (Llava, Qwen2.5-VL, Gemma3, Kimi-VL, Kimi-K2.5: `text_config`).
TRANSFORMERS_TEXT_CONFIG_KEYS = ("text_encoder", "decoder", "generator", "text_config")
# Wrappers transformers does not know (remote-code configs: InternVL's `llm_config`, Qwen-Omni's `thinker_config`,
# ...), searched in order, recursively, when the answer above has no `num_hidden_layers`.
NESTED_TEXT_CONFIG_KEYS = (
    "language_model",
    "llm_config",
    "language_config",
    "text_model",
    "llm",
    "thinker_config",
    "text_config",
)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _served_text_config(config: Any) -> Any:
    """What vLLM serves as the text model: for a config object vLLM's own `get_hf_text_config` (the
    `ModelConfig.hf_text_config` its model runner and aux-layer defaults use); for a config.json dict the same rule
    on its keys (the first of TRANSFORMERS_TEXT_CONFIG_KEYS present, else the config itself)."""
    if not isinstance(config, dict):
        from eagle3_ray.core.vllm_support import get_hf_text_config

        return get_hf_text_config(config)
    return next((config[k] for k in TRANSFORMERS_TEXT_CONFIG_KEYS if config.get(k) is not None), config)


def text_config(config: Any) -> Any:
    """The language model's config that owns `num_hidden_layers` (a dict or a config object), however it is nested:
    the config vLLM serves as the text model when it has layers, else the first wrapper key that leads to one. The
    one lookup for capture (capture.json), export and evaluate (the contract check), so they cannot disagree."""
    served = _served_text_config(config)
    if _get(served, "num_hidden_layers") is not None:
        return served
    for key in NESTED_TEXT_CONFIG_KEYS:
        inner = _get(config, key)
        if inner is not None and inner is not config:
            try:
                return text_config(inner)
            except ValueError:
                continue
    keys = sorted(config.keys()) if isinstance(config, dict) else sorted(vars(config))
    raise ValueError(
        f"verifier config has no num_hidden_layers, at the top or under any of "
        f"{list(dict.fromkeys(TRANSFORMERS_TEXT_CONFIG_KEYS + NESTED_TEXT_CONFIG_KEYS))}; "
        f"top-level keys: {keys}"
    )


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
                f"(e.g. [1, {num_layers // 2}, {num_layers - 2}])"
            )
        return ids, num_layers
    ids = list(aux_layer_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"verifier.aux_layer_ids must be unique, got {ids}")
    bad = [i for i in ids if not 0 < i < num_layers]
    if bad:
        raise ValueError(
            f"verifier.aux_layer_ids {bad} out of range: each id must satisfy 0 < id < {num_layers} "
            f"(num_hidden_layers); the final layer {num_layers} is always captured on its own"
        )
    return ids, num_layers


def decoder_layers(model: Any) -> Any:
    """A transformers causal LM's decoder layers: `model.model.layers`, or the language model's inside a multimodal
    wrapper (`model.model.language_model.layers`, Kimi-K2.5)."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def reference_hidden_states(model: Any, input_ids: Any, layer_ids: list[int]) -> Any:
    """What the capture stores for `input_ids` ([T] token ids), from transformers: [T, len(layer_ids), H] float32.

    Id k < L is the input of decoder layer k (HF `hidden_states[k]`); id L is the last layer's output before the
    final norm (HF's `hidden_states[L]` is the normed state, so it is not used). One forward pass with hooks, no
    `output_hidden_states`, so an 8B model's reference costs one layer's states per id, not all of them."""
    import torch

    layers = decoder_layers(model)
    num_layers = len(layers)
    seen: dict[int, torch.Tensor] = {}

    def keep_input(k: int):
        return lambda _m, args, kwargs: seen.__setitem__(k, (args[0] if args else kwargs["hidden_states"])[0])

    def keep_output(_m, _args, _kwargs, output):
        seen[num_layers] = (output[0] if isinstance(output, tuple) else output)[0]

    hooks = [layers[k].register_forward_pre_hook(keep_input(k), with_kwargs=True) for k in layer_ids if k < num_layers]
    hooks.append(layers[-1].register_forward_hook(keep_output, with_kwargs=True))
    ids = torch.as_tensor(input_ids, device=model.device).reshape(1, -1)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([seen[k].float() for k in layer_ids], dim=1)  # shape: [T, len(layer_ids), H]
