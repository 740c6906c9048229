"""Checks that the unit tier runs on the CPU and tests/gpu runs again on CUDA (`bash gpu_machine/run_checks.sh
pytest_gpu`), and the tiny training data both tiers read."""

from __future__ import annotations

import torch

from bench import gpu_train_bench as gb
from eagle3_ray.core import shard_writer


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
