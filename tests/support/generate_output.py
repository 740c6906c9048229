"""A generate-stage output without vLLM for the tests of the stages downstream of it (train, export, evaluate):
the library's own `generate.reference.write_reference_output`, built once per session.

    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    point_generate_at(cfg, gen_dir)
"""

from __future__ import annotations

from pathlib import Path

from eagle3_ray.core import stage
from eagle3_ray.generate.reference import write_reference_output


def point_generate_at(cfg, gen_dir: str) -> None:
    """Make an existing generate output the one `cfg` determines: its version dir becomes a symlink to `gen_dir`."""
    link = Path(stage.output_dir(cfg, "generate"))
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(gen_dir, target_is_directory=True)


def shared_generate_output(tmp_path_factory, verifier_dir: str, **kwargs) -> str:
    """One generate output per pytest session (built on first use, reused by every module that asks)."""
    return write_reference_output(str(tmp_path_factory.getbasetemp() / "generate-fixture"), verifier_dir, **kwargs)
