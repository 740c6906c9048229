"""Checks that the unit tier runs on the CPU and tests/gpu runs again on CUDA (`bash gpu_machine/run_checks.sh
pytest_gpu`), and the tiny training data both tiers read."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from bench import gpu_train_bench as gb
from eagle3_ray.core import shard_writer
from eagle3_ray.core.config import config_from_dict


def planned_rows_cut_by_sample_are_each_samples_planned_capture(device: str, dtype: str) -> None:
    """The connector encodes and takes the norms of all of an engine step's planned samples at once
    (shard_writer.planned_rows over their token rows one after the other); cut at each sample's rows (planned_sample)
    that is the sample's own planned_capture (stored bytes equal, norms to fp32 rounding), zero rows and NaN/inf counted
    in the sample they are in."""
    lengths = [5, 1, 8, 3]
    rows = torch.randn(sum(lengths), 3, 16, device=device).to(torch.bfloat16)  # shape: [N, L, H]
    rows[2, 1] = 0.0  # sample 0
    rows[5, 0, 3], rows[6, 2, :2] = torch.nan, torch.inf  # sample 1 (its only row), sample 2
    step = shard_writer.planned_rows(rows, dtype)
    assert set(step) == ({"hs", "scale"} if dtype == "fp8" else {"hs"}) | {"norms", "nonfinite"}
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    nonfinite = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        got = shard_writer.planned_sample({name: t[a:b].cpu() for name, t in step.items()}, f"s{i}")
        want = {
            n: t.cpu() for n, t in shard_writer.planned_capture(rows[a:b], {"key": f"s{i}", "dtype": dtype}).items()
        }
        assert got.keys() == want.keys()
        for name in set(want) - {"norms"}:
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (i, name)
        torch.testing.assert_close(got["norms"], want["norms"], rtol=1e-6, atol=0, equal_nan=True)
        nonfinite.append(got["nonfinite"].tolist())
    assert nonfinite == [[0, 0, 0], [1, 0, 0], [0, 0, 2], [0, 0, 0]]


def tiny_bench_run(tmp_path) -> tuple[str, str]:
    """(generate dir, vocab dir): 16 synthetic samples of the tiny shape bench/gpu_train_bench.py writes, with a draft
    vocabulary of 128."""
    verifier = gb.write_verifier(str(tmp_path / "verifier"), gb.TINY, "cpu")
    samples = gb.make_samples(16, 20, 40, len(gb.AUX_TINY) + 1, gb.TINY["hidden_size"], gb.TINY["vocab_size"])
    gen_dir, spec_dir = gb.write_both_formats(str(tmp_path), verifier, gb.TINY, gb.AUX_TINY, samples)
    return gen_dir, gb.write_vocabs(str(tmp_path), gen_dir, spec_dir, 128, gb.TINY["vocab_size"])


def drafter_dir(tmp_path, config: dict, tensors: dict | None = None) -> str:
    """A speculators drafter directory under tmp_path: config.json and model.safetensors."""
    d = tmp_path / "drafter"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file(tensors or {"lm_head.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    return str(d)


def drafter_loads_into_a_run_with_another_draft_vocabulary(device: str, tiny_llama: str, tmp_path) -> None:
    """train.init_from's load (init_from.load_into) into a run's drafter built on `device`, with a draft vocabulary
    of its own: the layers are the drafter's, each head row follows its token (a token the drafter lacks keeps the
    run's fresh row), the run's d2t stays."""
    from eagle3_ray.generate.output import capture_contract
    from eagle3_ray.train import checkpoints, init_from, vocab, worker

    def model(name: str, counts, draft_vocab_size: int):
        vocab_dir = str(tmp_path / name)
        vocab.save_vocab(vocab_dir, *vocab.build_vocab(counts, draft_vocab_size, capture["vocab_size"]), counts)
        cfg = config_from_dict(
            {"verifier": {"path": tiny_llama}, "train": {"draft_vocab_size": draft_vocab_size, "compile": "off"}}
        )
        return worker.build_model(cfg, capture, vocab_dir, torch.device(device))

    capture = capture_contract(config_from_dict({"verifier": {"aux_layer_ids": [1, 3, 4]}}), tiny_llama)
    torch.manual_seed(1)
    old = model("old", vocab.count_tokens([(list(range(300)), [1] * 300)]), 256)
    with torch.no_grad():
        old.lm_head.weight.normal_()  # a head trained away from the verifier's rows
    path = drafter_dir(tmp_path, old.config.to_dict(), checkpoints.trainable_state_dict(old))
    torch.manual_seed(2)
    new = model("new", vocab.count_tokens([(list(range(200, 500)), [1] * 300)]), 128)
    fresh_head = new.lm_head.weight.detach().clone()
    try:
        init_from.load_into(new, path, "0" * 64)
        raise AssertionError("a changed model.safetensors must be refused")
    except ValueError as err:
        assert "changed meanwhile" in str(err)
    counts = init_from.load_into(
        new, path, init_from.fingerprint((tmp_path / "drafter" / "model.safetensors").read_bytes())
    )
    assert torch.equal(new.fc.weight, old.fc.weight)
    assert torch.equal(new.layers[0].mlp.down_proj.weight, old.layers[0].mlp.down_proj.weight)
    old_ids = init_from.draft_token_ids(old.d2t.cpu(), 256)
    new_ids = init_from.draft_token_ids(new.d2t.cpu(), 128)
    for draft_id, token in enumerate(new_ids.tolist()):
        hits = (old_ids == token).nonzero()
        expected = old.lm_head.weight[hits[0, 0]] if len(hits) else fresh_head[draft_id]
        assert torch.equal(new.lm_head.weight[draft_id], expected)
    assert counts["rows_from_drafter"] == int(torch.isin(new_ids, old_ids).sum()) > 0
    assert counts["new_rows"] > 0
    assert torch.equal(new.d2t.cpu(), vocab.load_vocab(str(tmp_path / "new"))[0])  # the run's own mapping stays
