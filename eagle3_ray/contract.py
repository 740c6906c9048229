"""The capture/serving contract: the drafter, the captured data and the verifier must agree, or vLLM serves a drafter
that was trained on different features than it gets (silently: 1% acceptance, vLLM issue 50170).

    check_contract(drafter_config, capture, verifier_config, drafter_where=..., capture_where=..., verifier_where=...)

checks that
- the drafter's `eagle_aux_hidden_state_layer_ids` equal the ids the data was captured at (`capture.json`);
- the final layer was captured pre-norm, as id L = num_hidden_layers, which is what the drafter expects;
- the verifier architecture, vocab size and hidden size are the same on all three sides.
Every mismatch is listed in one `ValueError` that says which side says what. `vllm_aux_layer_ids(llm)` reads the aux
layers a running vLLM engine uses from the engine's own config, through the function its model runner calls.
"""

from __future__ import annotations

from typing import Any

from eagle3_ray import storage

# speculators' Eagle3DraftModel.forward computes its targets as verifier_lm_head(verifier_norm(last_hidden)): it applies
# the verifier's final norm itself, so the stored final layer must be the residual stream *before* that norm.
DRAFTER_FINAL_LAYER_NORM = "pre"
TEXT_CONFIG_KEYS = ("text_config", "language_model", "llm_config", "thinker_config")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a (possibly multimodal) HF config dict: `text_config`, `language_model`, ..."""
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and "hidden_size" in nested:
            return {**nested, "architectures": config.get("architectures")}
    return config


def drafter_facts(config: dict[str, Any]) -> dict[str, Any]:
    """What a speculators Eagle3 config.json says about the verifier and the features it expects."""
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"drafter config speculators_model_type={config.get('speculators_model_type')!r}: "
                         "only speculators 'eagle3' drafters are supported")
    layer = config["transformer_layer_config"]
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return {"aux_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
            "hidden_size": config.get("target_hidden_size") or layer["hidden_size"],
            "vocab_size": layer["vocab_size"], "architectures": verifier.get("architectures"),
            "final_layer_norm": DRAFTER_FINAL_LAYER_NORM}


def _mismatches(drafter: dict, capture: dict, verifier: dict | None, where: dict[str, str]) -> list[str]:
    d, c = f"drafter config ({where['drafter']})", f"capture.json ({where['capture']})"
    problems = []
    if list(drafter["aux_layer_ids"] or []) != list(capture["aux_layer_ids"]):
        problems.append(f"{d} eagle_aux_hidden_state_layer_ids={drafter['aux_layer_ids']} but data was captured at "
                        f"{capture['aux_layer_ids']} ({where['capture']})")
    if capture.get("final_layer_norm") != drafter["final_layer_norm"]:
        problems.append(f"{c} final_layer_norm={capture.get('final_layer_norm')!r} but the drafter (speculators "
                        f"eagle3) applies the verifier norm itself and expects {drafter['final_layer_norm']!r}")
    if capture.get("final_layer_id") != capture.get("num_hidden_layers"):
        problems.append(f"{c} final_layer_id={capture.get('final_layer_id')} but the verifier has "
                        f"num_hidden_layers={capture.get('num_hidden_layers')}: the target must be the last layer")
    for key, cap_key in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                         ("architectures", "verifier_architectures")):
        if drafter[key] != capture.get(cap_key):
            problems.append(f"{d} verifier {key}={drafter[key]} but {c} says {cap_key}={capture.get(cap_key)}")
    if verifier is not None:
        v = f"verifier config ({where['verifier']})"
        for key, cap_key in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                             ("num_hidden_layers", "num_hidden_layers"), ("architectures", "verifier_architectures")):
            if verifier.get(key) != capture.get(cap_key):
                problems.append(f"{v} {key}={verifier.get(key)} but {c} says {cap_key}={capture.get(cap_key)}")
    return problems


def check_contract(drafter_config: dict[str, Any], capture: dict[str, Any], verifier_config: dict[str, Any] | None,
                   *, drafter_where: str, capture_where: str, verifier_where: str = "") -> dict[str, Any]:
    """Raise ValueError listing every disagreement; return the agreed facts (aux ids, final layer, sizes)."""
    drafter = drafter_facts(drafter_config)
    verifier = text_config(verifier_config) if verifier_config is not None else None
    where = {"drafter": drafter_where, "capture": capture_where, "verifier": verifier_where}
    problems = _mismatches(drafter, capture, verifier, where)
    if problems:
        raise ValueError("capture/serving contract violated:\n  - " + "\n  - ".join(problems))
    return {"aux_layer_ids": list(capture["aux_layer_ids"]), "final_layer_id": capture["final_layer_id"],
            "final_layer_norm": capture["final_layer_norm"], "hidden_size": capture["hidden_size"],
            "vocab_size": capture["vocab_size"], "verifier_architectures": capture["verifier_architectures"]}


def check_dir(drafter_dir: str, capture: dict[str, Any], verifier_dir: str | None, *, capture_where: str) -> dict:
    """`check_contract` on a drafter directory's config.json and a verifier directory's config.json."""
    drafter_config = storage.read_json(storage.join(drafter_dir, "config.json"))
    verifier_config = storage.read_json(storage.join(verifier_dir, "config.json")) if verifier_dir else None
    return check_contract(drafter_config, capture, verifier_config, drafter_where=f"{drafter_dir}/config.json",
                          capture_where=capture_where, verifier_where=f"{verifier_dir}/config.json")


def vllm_aux_layer_ids(llm) -> tuple[int, ...] | None:
    """The aux layers a vLLM engine with an eagle3 speculator captures, read from the engine's config object with the
    same function its model runner uses (`_get_eagle3_aux_layers_from_config`). None means vLLM falls back to its
    default layers (2, L//2, L-3), which is never what a trained drafter wants."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    speculative_config = llm.llm_engine.vllm_config.speculative_config
    return GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=speculative_config))


def check_vllm_aux_layers(vllm_ids: tuple[int, ...] | list[int] | None, capture: dict[str, Any], *,
                          capture_where: str) -> None:
    if vllm_ids is None or list(vllm_ids) != list(capture["aux_layer_ids"]):
        said = "its default layers (no ids in the drafter config)" if vllm_ids is None else list(vllm_ids)
        raise ValueError(f"vLLM uses aux layers {said} but data was captured at {capture['aux_layer_ids']} "
                         f"({capture_where})")
