"""train.init_from without Ray: the contract of a drafter to start from (core/contract.py), the head-row remapping
between two draft vocabularies, and loading a real speculators drafter into a run's freshly built one."""

from __future__ import annotations

import pytest
import torch

from eagle3_ray.core.config import TrainConfig, UserError, config_from_dict, versioned
from eagle3_ray.core.contract import initial_drafter_problems
from eagle3_ray.train import init_from
from tests.support.device_checks import drafter_dir as _drafter_dir
from tests.support.device_checks import drafter_loads_into_a_run_with_another_draft_vocabulary

pytestmark = pytest.mark.unit

CAPTURE = {
    "aux_layer_ids": [1, 3, 4],
    "final_layer_id": 6,
    "hidden_size": 256,
    "vocab_size": 4096,
    "verifier_architectures": ["LlamaForCausalLM"],
    "verifier_path": "/verifier",
}


def drafter_config(**changes) -> dict:
    """The fields of a speculators eagle3 config.json that the contract reads, as this project's training writes
    them for the tiny Llama; `changes` replace top-level fields, `layer` entries of transformer_layer_config."""
    layer = {"hidden_size": 256, "vocab_size": 4096, "num_hidden_layers": 1, **changes.pop("layer", {})}
    config = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
        "draft_vocab_size": 1024,
        "speculators_config": {"verifier": {"architectures": ["LlamaForCausalLM"]}},
        **init_from.trained_flags(TrainConfig()),
    }
    return {**config, **changes}


def problems(config: dict, num_draft_layers: int = 1) -> list[str]:
    return initial_drafter_problems(
        config,
        CAPTURE,
        flags=init_from.trained_flags(TrainConfig()),
        num_draft_layers=num_draft_layers,
        drafter_where="d/config.json",
        verifier_where="/verifier/config.json",
    )


def test_a_drafter_trained_for_the_same_verifier_and_layers_fits_whatever_its_draft_vocabulary():
    assert problems(drafter_config()) == []
    assert problems(drafter_config(draft_vocab_size=32000)) == []


@pytest.mark.parametrize(
    ("changes", "drafter_side", "run_side"),
    [
        ({"layer": {"hidden_size": 576}}, "hidden_size=576", "has hidden_size=256"),
        ({"layer": {"vocab_size": 49152}}, "vocab_size=49152", "has vocab_size=4096"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, "eagle_aux_hidden_state_layer_ids=[2, 3, 4]", "[1, 3, 4]"),
        ({"norm_output": False}, "norm_output=False", "norm_output=True"),
        ({"norm_before_fc": False, "fc_norm": True}, "fc_norm=True", "fc_norm=False"),
        ({"layer": {"num_hidden_layers": 2}}, "num_hidden_layers=2", "train.num_draft_layers=1"),
    ],
)
def test_each_mismatch_that_cannot_be_adapted_names_the_field_on_both_sides(changes, drafter_side, run_side):
    found = problems(drafter_config(**changes))
    assert found and any(drafter_side in p and run_side in p for p in found), found
    assert all(p.startswith("train.init_from (d/config.json) ") and "\n" not in p for p in found)


def test_head_rows_follow_their_tokens_into_the_new_draft_vocabulary_and_new_tokens_keep_fresh_rows():
    old_ids = torch.tensor([5, 7, 9])
    old_rows = torch.tensor([[5.0, 5.0], [7.0, 7.0], [9.0, 9.0]])
    new_ids = torch.tensor([7, 3, 9, 11])
    fresh = torch.full((4, 2), -1.0)
    rows, kept = init_from.remap_head_rows(old_rows, old_ids, fresh, new_ids)
    assert kept == 2
    assert rows.tolist() == [[7.0, 7.0], [-1.0, -1.0], [9.0, 9.0], [-1.0, -1.0]]
    assert fresh.eq(-1).all()  # the fresh rows are not changed in place
    counts = init_from.head_row_counts(old_ids, new_ids)
    assert counts == {"drafter": 3, "run": 4, "rows_from_drafter": 2, "new_rows": 2}


def test_draft_ids_map_to_verifier_tokens_through_d2t_offsets_or_as_they_are_without_d2t():
    assert init_from.draft_token_ids(torch.tensor([3, 3, 10]), 3).tolist() == [3, 4, 12]
    assert init_from.draft_token_ids(None, 4).tolist() == [0, 1, 2, 3]
    no_head = init_from.drafter_token_ids({"fc.weight": torch.zeros(2, 6)})  # leaves the head to the verifier's
    assert init_from.head_row_counts(no_head, torch.tensor([4, 5])) == {
        "drafter": 0,
        "run": 2,
        "rows_from_drafter": 0,
        "new_rows": 2,
    }


def test_init_from_is_part_of_the_train_version_and_a_local_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cold = config_from_dict({}).train
    warm = config_from_dict({"train": {"init_from": "old/speculators"}}).train
    assert warm.init_from == str(tmp_path / "old" / "speculators")
    assert versioned(warm) != versioned(cold)
    assert config_from_dict({"train": {"init_from": "s3://b/d"}}).train.init_from == "s3://b/d"


def test_check_refuses_in_one_line_and_says_what_a_drafter_dir_lacks(tmp_path):
    cfg = config_from_dict({"train": {"init_from": _drafter_dir(tmp_path, drafter_config(layer={"hidden_size": 576}))}})
    with pytest.raises(UserError) as err:
        init_from.check(cfg, CAPTURE)
    assert "\n" not in str(err.value) and "hidden_size=576" in str(err.value) and "hidden_size=256" in str(err.value)
    (tmp_path / "drafter" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors"):
        init_from.check(cfg, CAPTURE)
    other = config_from_dict({"train": {"init_from": _drafter_dir(tmp_path, {"speculators_model_type": "mlp"})}})
    with pytest.raises(UserError, match="is not a speculators eagle3 drafter config"):
        init_from.check(other, CAPTURE)


def test_a_drafter_loads_into_a_run_with_another_draft_vocabulary_rows_following_their_tokens(tiny_llama, tmp_path):
    drafter_loads_into_a_run_with_another_draft_vocabulary("cpu", tiny_llama, tmp_path)
