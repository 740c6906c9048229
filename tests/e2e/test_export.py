"""Export stage and contract check on a real speculators drafter trained briefly on the tiny verifier's outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from eagle3_ray.core import contract, storage
from eagle3_ray.core.config import UserError, config_from_dict
from eagle3_ray.train import export
from tests.support.drafters import attach, cached_run

pytestmark = pytest.mark.e2e


def make_cfg(run_dir, verifier_dir: str, **export_fields):
    return attach(
        config_from_dict(
            {
                "run": {"storage_path": str(run_dir.parent), "name": run_dir.name},
                "verifier": {"path": verifier_dir, "max_model_len": 512},
                "export": export_fields,
            }
        )
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_llama):
    """Two epochs of a trained drafter (best = epoch 0, last = epoch 1), shared with test_evaluate.py."""
    return cached_run(tmp_path_factory, tiny_llama, "trained", num_steps=60, num_epochs=2)


@pytest.fixture(scope="module")
def exported(run_dir, tiny_llama):
    return export.run(make_cfg(run_dir, tiny_llama))


def test_export_writes_bf16_speculators_drafter_without_optimizer_or_frozen_verifier_weights(exported, tiny_llama):
    out = exported["speculators_dir"]
    assert sorted(p.split("/")[-1] for p in storage.list_files(out)) == ["config.json", "model.safetensors"]
    config = storage.read_json(storage.join(out, "config.json"))
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert config["speculators_config"]["verifier"] == {
        "architectures": ["LlamaForCausalLM"],
        "name_or_path": tiny_llama,
    }
    assert config["draft_vocab_size"] == 1024 and config["dtype"] == "bfloat16"
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert not [k for k in tensors if k.startswith(("embed_tokens", "verifier_lm_head", "verifier_norm"))]
    expected = {"fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d", "layers.0.self_attn.q_proj.weight"}
    assert expected <= set(tensors)
    assert {t.dtype for k, t in tensors.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["lm_head.weight"].shape == (1024, 256)


def test_exported_drafter_loads_in_speculators_with_the_checkpoint_weights(exported, run_dir, tiny_llama):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3_ray.train.checkpoints import load_drafter

    # speculators' from_pretrained, then its own refill of the embeddings from the verifier named in config.json
    # (from_pretrained alone leaves weights absent from the file uninitialised)
    model = load_drafter(exported["speculators_dir"])
    ckpt = load_file(f"{exported['checkpoint']['path']}/model.safetensors")
    assert torch.equal(model.fc.weight.to(torch.bfloat16), ckpt["fc.weight"].to(torch.bfloat16))
    verifier = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert torch.equal(model.embed_tokens.weight.float(), verifier.model.embed_tokens.weight.float())
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]


def test_export_picks_best_last_or_a_named_epoch_and_lists_epochs_it_does_not_have(run_dir):
    latest = storage.latest(str(run_dir), "train")
    assert export.pick_checkpoint(latest, "best")["epoch"] == 0
    assert export.pick_checkpoint(latest, "last")["path"].endswith("epoch_1")
    assert export.pick_checkpoint(latest, "epoch=0")["path"].endswith("epoch_0")
    with pytest.raises(ValueError, match=r"epoch=7.*keeps epochs \[0, 1\]"):
        export.pick_checkpoint(latest, "epoch=7")


def test_export_of_last_checkpoint_is_its_own_version_and_a_rerun_is_a_no_op(exported, run_dir, tiny_llama, capsys):
    last = export.run(make_cfg(run_dir, tiny_llama, checkpoint="last"))
    assert last["version"] != exported["version"] and last["checkpoint"]["epoch"] == 1
    again = export.run(make_cfg(run_dir, tiny_llama, checkpoint="last"))
    # `last` itself may be a skip: test_evaluate.py exports the same checkpoint of the shared run first
    assert again.pop("skipped") and again == {k: v for k, v in last.items() if k != "skipped"}
    assert "already_done" in capsys.readouterr().out
    export.run(make_cfg(run_dir, tiny_llama))  # leave LATEST on the best checkpoint for the other tests


def test_drafter_listing_other_aux_layer_ids_than_the_captured_data_is_refused_naming_both(
    run_dir, tiny_llama, tmp_path
):
    bad_run = tmp_path / "bad"
    shutil.copytree(run_dir, bad_run, ignore=shutil.ignore_patterns("export"), symlinks=True)
    best = storage.latest(str(run_dir), "train")["best"]["path"]
    summary = bad_run / "train" / "v-test" / "summary.json"
    summary.write_text(summary.read_text().replace(str(run_dir), str(bad_run)))
    config_path = bad_run / best.removeprefix(str(run_dir) + "/") / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"eagle_aux_hidden_state_layer_ids=\[1, 3, 5\] but data was captured at "
        r"\[1, 3, 4\] \(.*capture\.json\)",
    ):
        export.run(make_cfg(bad_run, tiny_llama))
    assert not (bad_run / "export" / "LATEST.json").exists()


def test_contract_says_which_side_says_what_for_norm_sizes_and_architecture(exported, tiny_llama):
    drafter = storage.read_json(storage.join(exported["speculators_dir"], "config.json"))
    verifier = json.loads(open(f"{tiny_llama}/config.json").read())
    capture = storage.read_json(storage.join(exported["speculators_dir"], "..", "capture.json"))
    assert contract.check_contract(drafter, capture, verifier, drafter_where="d", capture_where="c")[
        "aux_layer_ids"
    ] == [1, 3, 4]
    bad = {**capture, "final_layer_norm": "post", "hidden_size": 512, "verifier_architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ValueError) as err:
        contract.check_contract(drafter, bad, verifier, drafter_where="d", capture_where="c", verifier_where="v")
    message = str(err.value)
    assert "final_layer_norm='post'" in message and "expects 'pre'" in message
    assert "drafter config (d) verifier hidden_size=256 but capture.json (c) says hidden_size=512" in message
    assert (
        "verifier config (v) architectures=['LlamaForCausalLM'] but capture.json (c) says "
        "verifier_architectures=['Qwen3ForCausalLM']" in message
    )
    nested = {"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {**verifier, "vocab_size": 99}}
    with pytest.raises(ValueError, match="vocab_size=99"):
        contract.check_contract(drafter, capture, nested, drafter_where="d", capture_where="c", verifier_where="v")


def synthetic_drafter_config(**flags) -> dict:
    """The parts of a speculators eagle3 config.json that the serving check reads."""
    return {
        "speculators_model_type": "eagle3",
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": False,
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 256},
        "speculators_config": {"verifier": {"architectures": ["LlamaForCausalLM"]}},
        **flags,
    }


def test_a_drafter_config_vllm_0_24_would_misread_is_refused_with_the_reason_and_the_fix():
    config = synthetic_drafter_config(norm_output=True)
    with pytest.raises(ValueError) as err:
        contract.check_serving(config, "0.24.0", where="in d/config.json")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("vLLM 0.24.0 would silently misread the drafter in d/config.json")
    assert "norm_output=True is not carried over by vLLM 0.24.0's speculators loader" in message
    assert "the drafter would run with norm_output=False" in message
    assert "export.serving_vllm_version=0.32" in message and "export.vllm_compat_layout=true" in message
    assert "fc_norm" not in message.split("(it copies only")[0]  # fc_norm=False reads the same everywhere


def test_the_same_drafter_config_passes_for_vllm_0_32_and_0_33_and_for_0_24_in_the_compat_layout():
    config = synthetic_drafter_config(norm_output=True)
    checked = contract.check_serving(config, "0.32.0", where="d")
    assert checked["flags"]["norm_output"] is True and checked["rules"] == "vLLM >= 0.32"
    assert contract.check_serving(config, "0.33.1", where="d")["rules"] == "vLLM >= 0.32"
    compat = {**config, "transformer_layer_config": {**config["transformer_layer_config"], "norm_output": True}}
    assert contract.check_serving(compat, "0.24", where="d")["flags"]["norm_output"] is True


def test_vllm_0_24_refuses_a_deepseek_drafter_that_reads_the_final_layer_and_unknown_old_versions():
    config = synthetic_drafter_config(
        eagle_aux_hidden_state_layer_ids=[2, 30, 61],
        speculators_config={"verifier": {"architectures": ["DeepseekV3ForCausalLM"]}},
    )
    with pytest.raises(
        ValueError,
        match=r"DeepseekV3ForCausalLM .* \(aux id 61\), which vLLM 0.24's DeepSeek-V2/V3 "
        r"code cannot capture",
    ):
        contract.check_serving(config, "0.24", where="d", num_hidden_layers=61)
    assert contract.check_serving(config, "0.32", where="d", num_hidden_layers=61)
    with pytest.raises(ValueError, match=r"vLLM 0.20.1 is older than every supported serving vLLM"):
        contract.check_serving(config, "0.20.1", where="d")


def test_export_for_vllm_0_24_picks_the_compat_layout_and_refuses_the_plain_one_when_asked_for(run_dir, tiny_llama):
    summary = export.run(make_cfg(run_dir, tiny_llama, serving_vllm_version="0.24"))
    config = storage.read_json(storage.join(summary["speculators_dir"], "config.json"))
    assert config["norm_output"] is config["transformer_layer_config"]["norm_output"] is True
    assert summary["serving_vllm"]["vllm_version"] == "0.24" and summary["serving_vllm"]["flags"]["norm_output"]
    with pytest.raises(
        UserError,
        match=r"^vLLM 0.24 would silently misread the drafter exported from \S+/best: norm_output=True is not "
        r"carried over[^\n]*$",
    ):
        export.run(make_cfg(run_dir, tiny_llama, serving_vllm_version="0.24", vllm_compat_layout=False))
    export.run(make_cfg(run_dir, tiny_llama))  # leave LATEST on the default export for the other tests


def test_export_for_the_installed_vllm_keeps_the_plain_speculators_layout(exported):
    config = storage.read_json(storage.join(exported["speculators_dir"], "config.json"))
    assert config["norm_output"] is True and "norm_output" not in config["transformer_layer_config"]


def test_export_records_the_installed_vllm_it_was_checked_against(exported):
    assert exported["serving_vllm"]["vllm_version"] == contract.installed_vllm_version() == "0.32.0"
    assert exported["serving_vllm"]["flags"] == {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": True,
    }
