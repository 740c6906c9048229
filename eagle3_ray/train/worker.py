"""The function every Ray Train worker runs: build the drafter, restore the last checkpoint, train epoch by epoch,
validate, and report metrics + a checkpoint once per epoch (rank 0 writes it; every rank calls report).

Metric names: `loss`, `acc_k` = speculators' full_acc_k (draft steps 0..k all correct, teacher-forced),
`cond_acc_k` (step k correct given 0..k-1 correct). Simulated acceptance length = 1 + sum_k acc_k, which equals
1 + sum_k prod_{j<=k} cond_acc_j: the expected tokens per verifier step with greedy drafts of length ttt_steps.
"""

from __future__ import annotations

import os
import queue
import signal
import tempfile
import threading
import time
import types
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConsistencyMode
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config
from speculators.train.optimizers import split_named_params_for_muon
from speculators.train.utils import normalize_counted_metrics
from transformers import get_cosine_schedule_with_warmup

from eagle3_ray.core import storage
from eagle3_ray.core.config import Config, TrainConfig, config_from_dict
from eagle3_ray.core.telemetry import JsonlWriter, log, metrics
from eagle3_ray.core.verifiers import verifier_dir_on_this_node
from eagle3_ray.train import acceptance, checkpoints, data, init_from, vocab


def build_model(cfg: Config, capture: dict, vocab_dir: str, device: torch.device) -> Eagle3DraftModel:
    """speculators' Eagle3 drafter; embeddings, verifier head and norm are loaded from the verifier (frozen)."""
    tc = cfg.train
    verifier = verifier_dir_on_this_node(cfg.verifier.path, capture["verifier_path"], cfg.verifier.dtype)
    attn = tc.attn_impl if tc.attn_impl != "auto" else ("simple_flex_attention" if tc.use_gpu else "sdpa")
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=tc.num_draft_layers,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=tc.total_seq_len,
        full_attention_indices=list(range(tc.num_draft_layers)),
    )
    d2t, t2d = vocab.load_vocab(vocab_dir)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=tc.draft_vocab_size,
        **init_from.trained_flags(cfg.train),
        ttt_steps=tc.ttt_steps,
        verifier_name_or_path=verifier,
        target_layer_ids=capture["aux_layer_ids"],
        draft_attn_impl=attn,
    )
    compile_forward(model, tc.compile)
    return model.to(device)


def compile_forward(model: Eagle3DraftModel, mode: str) -> None:
    """train.compile on this drafter. speculators wraps Eagle3DraftModel.forward in torch.compile at import when
    CUDA is present, and `auto` keeps that; `on` / `off` set the compiled / plain function on this instance, so the
    state_dict keys stay as they are and DDP (ray.train.torch.prepare_model, later) wraps the module as before.
    Dynamo compiles at the first call, the first step's forward and backward."""
    if mode == "auto":
        return
    forward = Eagle3DraftModel.forward
    forward = getattr(forward, "_torchdynamo_orig_callable", forward)  # the function under speculators' compile
    model.forward = types.MethodType(torch.compile(forward) if mode == "on" else forward, model)


def loss_kwargs(cfg: Config) -> dict[str, Any]:
    tc = cfg.train
    impl = "eager" if tc.loss_implementation == "auto" else tc.loss_implementation  # config.py says why
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=tc.loss, loss_implementation=impl, ttt_steps=tc.ttt_steps, ttt_step_loss_decay=1.0
    )
    return train_kwargs


@dataclass(slots=True)
class WorkerArgs:
    """What every train worker gets from the driver (train.py / online.py), built once there."""

    cfg: dict[str, Any]  # Config.to_dict()
    out_dir: str  # train/{version}/ (any storage)
    capture: dict[str, Any]  # the generate stage's capture.json
    val_ids: list[str]  # validation sample ids
    train_refs: list[data.SampleRef] = field(default_factory=list)  # offline: the samples to train on
    val_refs: list[data.SampleRef] = field(default_factory=list)  # offline: the samples to validate on
    steps_per_epoch: int | None = None  # online: estimated steps (None: the offline loader's length)
    cache_dir: str | None = None  # online with train.online_cache: where the first epoch's shards go
    init_from: dict[str, Any] | None = None  # train.init_from: its path and sha256 (init_from.record)
    kill_at: tuple[int, int] | None = field(default_factory=lambda: fault_injection_point())  # recovery tests only


# Recovery tests set this in the driver's environment ("epoch,step", 0-based): one train worker SIGKILLs itself there.
FAULT_INJECTION_ENV = "EAGLE3_RAY_TEST_KILL_WORKER_AT"


def fault_injection_point() -> tuple[int, int] | None:
    """The driver's test-only fault injection point (FAULT_INJECTION_ENV), read when WorkerArgs are built."""
    value = os.environ.get(FAULT_INJECTION_ENV)
    if not value:
        return None
    epoch, step = (int(x) for x in value.split(","))
    return epoch, step


def train_dtype(device: torch.device) -> torch.dtype:
    """The dtype hidden states are decoded to: bf16 on GPU (autocast), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def make_loaders(cfg: Config, args: WorkerArgs, rank: int, world: int, device: torch.device | None = None):
    """(train batches, val loader) over this rank's share of the samples; hidden states stay on storage until read.
    The train loader is wrapped in DeviceBatches, prepared ahead on `device` (default: this process's current GPU
    with train.use_gpu, else the CPU), one loader iteration through train.epochs; on CUDA its workers pack into
    reused shared-memory buffers (data.RingLoader), which DeviceBatches releases once it has copied a batch into
    pinned memory: prefetch_factor + 1 per worker, one batch ahead per worker from 4 workers on (8 workers: 16
    buffers, 4.3 GB at 8B / 8192 tokens, no more shared memory than 16 fresh batches in flight would take; a worker
    packs a batch in far less than 4 steps)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.use_gpu else torch.device("cpu")
    num_aux, hidden = len(args.capture["aux_layer_ids"]), args.capture["hidden_size"]
    dtype = torch.bfloat16 if cfg.train.use_gpu else torch.float32
    loaders = []
    num_workers = cfg.train.num_loader_workers
    num_workers = default_loader_workers(cfg.train.use_gpu) if num_workers is None else num_workers
    for part, workers in ((args.train_refs, num_workers), (args.val_refs, 0)):
        reuse = device.type == "cuda" and workers > 0
        ds = data.ShardDataset(
            part,
            num_aux,
            dtype=dtype,
            on_bad_sample=cfg.train.on_bad_sample,
            layer_ids=args.capture["layer_ids"],
            max_zero_row_share=cfg.generate.max_zero_row_share,
            max_nonfinite_values=cfg.generate.max_nonfinite_values,
        )
        loaders.append(
            data.make_loader(
                ds,
                total_seq_len=cfg.train.total_seq_len,
                hidden_size=hidden,
                world_size=world,
                rank=rank,
                seed=cfg.run.seed,
                num_workers=workers,
                reuse_buffers=reuse,
                prefetch_factor=1 if reuse and workers >= 4 else 2,
            )
        )
    return DeviceBatches(loaders[0], device, dtype, epochs=cfg.train.epochs), loaders[1]


class DeviceBatches:
    """The loader's batches with their tensors on `device`, hidden states decoded there to `dtype` (data.decode:
    fp8 is decoded by the GPU, after the copy), one epoch per iteration (the epoch set on `batch_sampler`).
    With `epochs` (the run's number of epochs) one loader iteration runs on through them all
    (data.EpochSampler.run_until): the loader's workers read the next epoch's first batches while this epoch's
    last steps, validation and the checkpoint run, and each epoch takes its own batches from it; an epoch that
    stops early, or an epoch other than the next one, starts the loader afresh. On CUDA a thread prepares the next
    `depth` batches while the current step runs: it copies each into pinned host memory (the caching host
    allocator's blocks, reused) with a few CPU threads, starts the host-to-device copy and the decode on a side
    stream, and hands over an event the compute stream waits on, so neither the loop nor the GPU waits for the copy
    unless the loader falls behind. Non-tensor entries (`error_records`, `num_tokens`) stay host numbers: reading
    them never waits for the GPU.
    A data.RingLoader's batch is released as soon as it is no longer read: after its pinned copy on CUDA, when the
    consumer asks for the next one on the CPU. `pin_s` / `h2d_events` time the copies (gpu_train_bench.py)."""

    def __init__(
        self,
        loader,
        device: torch.device,
        dtype: torch.dtype,
        *,
        epochs: int | None = None,
        depth: int = 2,
        pin_threads: int = 4,
    ):
        self.loader, self.device, self.dtype, self.depth, self.pin_threads = loader, device, dtype, depth, pin_threads
        self.batch_sampler = loader.batch_sampler
        self.batch_sampler.run_until(epochs)
        self.pin_s, self.num_copied = 0.0, 0
        self.h2d_events: deque = deque(maxlen=256)  # (start, end) CUDA events of recent copies + decodes
        self._run: _LoaderRun | None = None  # the loader iteration under way, and the epoch it gives next

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        epoch = self.batch_sampler.epoch
        run = self._run
        if run is None or not run.epoch == epoch < run.end:
            if run is not None:
                run.stop()
            run = self._run = _LoaderRun(self, epoch)
        finished = False
        try:
            for _ in range(len(self.batch_sampler.batches(epoch))):
                yield run.next()
            finished = True
        finally:
            if finished:
                run.epoch = epoch + 1
            else:  # stopped early: what the loader holds of this epoch is not the next epoch's
                run.stop()
                if self._run is run:
                    self._run = None

    def _produce(self, batches, ready: queue.Queue, stop: threading.Event) -> None:
        torch.set_num_threads(self.pin_threads)  # this thread's copies only (the DataLoader's pin loop uses one)
        stream = torch.cuda.Stream(self.device)
        try:
            with torch.cuda.device(self.device):
                for batch in batches:
                    try:
                        if stop.is_set():
                            return
                        item = self._copy(batch, stream)
                    finally:
                        self._release(batch)  # copied into pinned memory (or dropped): its buffer may be reused
                    ready.put(item)
        except BaseException as e:  # noqa: BLE001 (re-raised in the consuming thread)
            ready.put(e)
            return
        ready.put(None)

    def _release(self, batch: dict) -> None:
        release = getattr(self.loader, "release", None)
        if release is not None:
            release(batch)

    def _copy(self, batch: dict, stream: torch.cuda.Stream) -> tuple[dict, torch.cuda.Event]:
        t0 = time.perf_counter()
        pinned = {k: v.pin_memory() for k, v in batch.items() if isinstance(v, torch.Tensor)}  # synchronous
        self.pin_s += time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            tensors = to_device(pinned, self.device, self.dtype)
            end.record(stream)
        self.h2d_events.append((start, end))
        self.num_copied += 1
        host = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor) and k != data.RING_KEY}
        return {**host, **tensors}, end


class _LoaderRun:
    """One iteration of a DeviceBatches' loader, perhaps through several epochs: `next()` gives its next batch on
    the device, `epoch` is the epoch it gives next. On CUDA a thread copies `depth` batches ahead
    (DeviceBatches._produce); on the CPU the batch handed out last is released when the next one is asked for."""

    def __init__(self, owner: DeviceBatches, epoch: int):
        # A weak reference: DeviceBatches holds its run, so a strong one back would make a cycle, and a DataLoader
        # left to the cycle collector can be finalized queues first, its workers then waiting out a 5 s poll each.
        self.owner, self.epoch, self.cuda = weakref.proxy(owner), epoch, owner.device.type == "cuda"
        self.end = max(epoch + 1, owner.batch_sampler.end or 0)  # the epochs it gives: epoch .. end - 1
        batches = iter(owner.loader)  # the loader's workers start on this epoch's first batches now
        self.held: dict | None = None
        if self.cuda:
            self.ready: queue.Queue = queue.Queue(maxsize=owner.depth)
            self.stopping = threading.Event()
            self.thread = threading.Thread(
                target=owner._produce, args=(batches, self.ready, self.stopping), name="eagle3-h2d", daemon=True
            )
            self.thread.start()
        else:
            self.batches = batches

    def next(self) -> dict:
        if not self.cuda:
            self._release_held()
            self.held = next(self.batches, None)
            if self.held is None:
                raise RuntimeError(f"the training loader ended before epoch {self.epoch}'s batches did")
            host = {k: v for k, v in self.held.items() if k != data.RING_KEY}
            return {**host, **to_device(host, self.owner.device, self.owner.dtype)}
        item = self.ready.get()
        if item is None:
            raise RuntimeError(f"the training loader ended before epoch {self.epoch}'s batches did")
        if isinstance(item, BaseException):
            raise item
        batch, copied = item
        current = torch.cuda.current_stream(self.owner.device)
        current.wait_event(copied)
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(current)  # made on the side stream, freed after the step's use
        return batch

    def stop(self) -> None:
        """Idempotent."""
        self._release_held()
        if self.cuda:
            self.stopping.set()
            while self.thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self.ready.get(timeout=0.05)
                except queue.Empty:
                    pass

    def _release_held(self) -> None:
        if self.held is not None:
            self.owner._release(self.held)
            self.held = None


def collective_device() -> torch.device:
    """Where tensors for a collective must live: NCCL only reduces CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MetricSums:
    """speculators' `{name}_sum` / `{name}_total` metrics summed over steps (and ranks), normalized on read. Step
    tensors are summed where they are (the GPU): nothing waits for the device until `reduce()`."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}

    def add(self, step_metrics: dict[str, torch.Tensor], **extra: float) -> None:
        for k, v in {**step_metrics, **extra}.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def reduce(self) -> dict[str, float]:
        """Sum across ranks (every rank must call this at the same point); one device sync."""
        keys = sorted(self.sums)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        device = collective_device() if distributed else torch.device("cpu")
        t = (
            torch.stack([torch.as_tensor(self.sums[k]).double().reshape(()).to(device) for k in keys])
            if keys
            else torch.zeros(0, dtype=torch.float64)
        )
        if distributed:
            dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))


def summarize(sums: dict[str, float], ttt_steps: int, prefix: str) -> dict[str, float]:
    """Normalized loss and per-position accuracies (speculators' normalize_counted_metrics); `prefix` is `train_`
    or `val_`."""
    counted = normalize_counted_metrics({k: v for k, v in sums.items() if k.endswith(("_sum", "_total"))})
    out = {f"{prefix}loss": counted["loss"]}
    for k in range(ttt_steps):
        out[f"{prefix}acc_{k}"] = counted[f"full_acc_{k}"]
        out[f"{prefix}cond_acc_{k}"] = counted[f"cond_acc_{k}"]
    out[f"{prefix}acceptance_length"] = 1.0 + sum(out[f"{prefix}acc_{k}"] for k in range(ttt_steps))
    return out


def metric_tensors(metric_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keep = ("loss_sum", "loss_total", "full_acc_", "cond_acc_")
    return {k: v.detach() for k, v in metric_dict.items() if k.startswith(keep)}


def make_optimizers(model: torch.nn.Module, tc: TrainConfig, device: torch.device) -> list[torch.optim.Optimizer]:
    """The optimizers of `train.optimizer`, stepped together: `adamw`, one AdamW over every trainable parameter;
    `muon`, speculators' partition (split_named_params_for_muon, as its Trainer builds it): torch's Muon over the 2D
    weight matrices, then AdamW over the rest. AdamW runs fused into one kernel per step on CUDA, foreach on CPU."""
    adamw_kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    if tc.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return [torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, **adamw_kernel)]
    muon_params, adamw_params = split_named_params_for_muon(model)
    optimizers: list[torch.optim.Optimizer] = []
    if muon_params:
        optimizers.append(
            torch.optim.Muon(
                [p for _name, p in muon_params],
                lr=tc.lr if tc.muon_lr is None else tc.muon_lr,
                momentum=tc.muon_momentum,
                weight_decay=tc.muon_weight_decay,
                ns_steps=tc.muon_ns_steps,
                adjust_lr_fn=tc.muon_adjust_lr_fn,
            )
        )
    if adamw_params:
        optimizers.append(
            torch.optim.AdamW([p for _name, p in adamw_params], lr=tc.lr, weight_decay=tc.weight_decay, **adamw_kernel)
        )
    return optimizers


def make_schedulers(optimizers: list[torch.optim.Optimizer], warmup_steps: int, total_steps: int) -> list:
    """One linear-warmup + cosine schedule per optimizer, each scaling its own peak rate."""
    return [get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps) for opt in optimizers]


def current_lrs(optimizers: list[torch.optim.Optimizer]) -> dict[str, float]:
    """The scheduled rates of the next step: `lr` (AdamW's) and, with train.optimizer muon, `muon_lr`."""
    return {"muon_lr" if isinstance(opt, torch.optim.Muon) else "lr": opt.param_groups[0]["lr"] for opt in optimizers}


class TrainStep:
    """Forward, backward, clip, optimizer and scheduler steps on one packed batch: the worker loop's step, and the
    step bench/gpu_train_bench.py times. Returns the step's metric tensors left on the device: nothing in a step
    waits for the GPU, so the next batch's host-to-device copy and the loader overlap it."""

    def __init__(
        self,
        model,
        params: list[torch.nn.Parameter],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list,
        loss_kwargs: dict,
        device: torch.device,
        *,
        autocast: bool,
        max_grad_norm: float,
    ):
        self.model, self.params, self.optimizers, self.schedulers = model, params, optimizers, schedulers
        self.loss_kwargs, self.device, self.max_grad_norm = loss_kwargs, device, max_grad_norm
        self.autocast = autocast

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        tensors = to_device(batch, self.device)  # a no-op on DeviceBatches' batches
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            _draft, loss, step_metrics = self.model(**tensors, **self.loss_kwargs)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        for opt in self.optimizers:
            opt.step()
        for scheduler in self.schedulers:
            scheduler.step()
        return metric_tensors(step_metrics)


def batch_tokens(batch: dict) -> float:
    """Real (non-padding) tokens of a packed batch: data.PackedCollate's host count, else counted on the host copy
    (the online stream's batches)."""
    if "num_tokens" in batch:
        return float(batch["num_tokens"])
    return float((batch["document_ids"] != -1).sum())


def default_loader_workers(use_gpu: bool) -> int:
    """Loader processes per train worker when train.num_loader_workers is unset: on GPU the CPUs this process may
    use, shared among the node's GPUs, less one for the training loop (1..8); on CPU one."""
    if not use_gpu:
        return 1
    per_gpu = len(os.sched_getaffinity(0)) // max(1, torch.cuda.device_count())
    return max(1, min(8, per_gpu - 1))


def to_device(batch: dict, device: torch.device, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The batch's tensors (the model's inputs) on `device`, hidden states decoded there to `dtype` (default
    train_dtype(device)); tensors already there in `dtype` are returned as they are."""
    tensors = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return data.decode(tensors, dtype or train_dtype(device))


def _maybe_kill(kill_at: tuple[int, int] | None, out_dir: str, epoch: int, step: int, rank: int, world: int) -> None:
    """Test hook (FAULT_INJECTION_ENV): a real SIGKILL of rank 1 (rank 0 with one worker) at [epoch, step], once per
    run (the marker in the train dir survives the restart)."""
    if kill_at != (epoch, step) or rank != min(1, world - 1):
        return
    marker = storage.join(out_dir, "_fault_injected")
    if storage.exists(marker):
        return
    storage.write_bytes_atomic(marker, f"epoch={epoch} step={step} pid={os.getpid()}\n".encode())
    log("train", "fault_injection", epoch=epoch, step=step, rank=rank, pid=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


class MetricSinks:
    """Where rank 0's training metrics go (not a unit sink of generate's commit.py): a log line, metrics.jsonl,
    TensorBoard and Ray gauges. TensorBoard writes local files: on an object store they are written to a temp dir and
    uploaded on every `flush()` (each epoch)."""

    def __init__(self, out_dir: str, run_name: str, enabled: bool):
        self.enabled, self.out_dir = enabled, out_dir
        self.tags = {"stage": "train", "run": run_name}
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.jsonl = JsonlWriter(storage.join(out_dir, "metrics.jsonl"))
            tb_uri = storage.join(out_dir, "tensorboard")
            local = storage.is_local(tb_uri)
            self.tb_dir = storage.local_path(tb_uri) if local else tempfile.mkdtemp(prefix="eagle3-tb-")
            self.tb = SummaryWriter(self.tb_dir)

    def emit(self, kind: str, step: int, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        log("train", kind, step=step, **record)
        self.jsonl.write({"kind": kind, "step": step, **record})
        for k, v in record.items():
            if isinstance(v, float):
                self.tb.add_scalar(f"{kind}/{k}", v, step)
        loss_key = "train_loss" if kind == "train" else "val_loss"
        metrics.gauge(loss_key, "drafter loss").set(record[loss_key], tags=self.tags)
        acc_key = "train_acc_0" if kind == "train" else "val_acc_0"
        metrics.gauge(acc_key, "drafter first-position accuracy").set(record[acc_key], tags=self.tags)
        metrics.gauge("epoch", "current training epoch").set(record["epoch"], tags=self.tags)

    def flush(self) -> None:
        if not self.enabled:
            return
        self.jsonl.flush()
        self.tb.flush()
        tb_uri = storage.join(self.out_dir, "tensorboard")
        if not storage.is_local(tb_uri):
            for name in os.listdir(self.tb_dir):
                storage.copy_file(os.path.join(self.tb_dir, name), storage.join(tb_uri, name))


class Loop:
    """One worker's training state and its epoch/validation/checkpoint steps."""

    def __init__(self, args: WorkerArgs):
        self.cfg = config_from_dict(args.cfg)
        self.args, self.out_dir = args, args.out_dir
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        torch.manual_seed(self.cfg.run.seed)
        tc = self.cfg.train
        self.raw = build_model(self.cfg, args.capture, storage.join(self.out_dir, "vocab"), self.device)
        self.model = ray.train.torch.prepare_model(self.raw)
        params = [p for p in self.raw.parameters() if p.requires_grad]
        self.optimizers = make_optimizers(self.raw, tc, self.device)
        steps_per_epoch = args.steps_per_epoch
        if steps_per_epoch is None:
            self.train_loader, self.val_loader = make_loaders(self.cfg, args, self.rank, self.world, self.device)
            steps_per_epoch = len(self.train_loader)
        self.steps_per_epoch = steps_per_epoch
        self.schedulers = make_schedulers(self.optimizers, tc.warmup_steps, tc.epochs * self.steps_per_epoch)
        self.kwargs = loss_kwargs(self.cfg)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=tc.use_gpu)
        self.train_step = TrainStep(
            self.model,
            params,
            self.optimizers,
            self.schedulers,
            self.kwargs,
            self.device,
            autocast=tc.use_gpu,
            max_grad_norm=tc.max_grad_norm,
        )
        self.sinks = MetricSinks(self.out_dir, self.cfg.run.name, self.rank == 0)
        self.start_epoch, self.step, self.best = 0, 0, None

    def restore(self) -> None:
        """Resume after the last reported checkpoint: weights, optimizer, scheduler, RNG, epoch and step. A run
        without a checkpoint of its own starts from `train.init_from`'s weights, if set."""
        node = ray.get_runtime_context().get_node_id()
        log("train", "worker_started", rank=self.rank, world=self.world, node=node, pid=os.getpid())
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            if self.args.init_from is not None:
                self._start_from(self.args.init_from)
            return
        with ckpt.as_directory() as d:
            state = checkpoints.restore(d, self.raw, self.optimizers, self.schedulers)
        self.start_epoch, self.step, self.best = state["epoch"] + 1, state["step"], state["best"]
        if self.rank == 0:
            resumed = {"from_epoch": state["epoch"], "next_epoch": self.start_epoch, "step": self.step, "node": node}
            log("train", "resumed", **resumed)
            self.sinks.jsonl.write({"kind": "resumed", **resumed})
            self._repair_best(state)

    def _start_from(self, init: dict[str, Any]) -> None:
        counts = init_from.load_into(self.raw, init["path"], init["sha256"])
        if self.rank == 0:
            log("train", "started_from", path=init["path"], sha256=init["sha256"], **counts)
            self.sinks.jsonl.write({"kind": "started_from", "path": init["path"], "sha256": init["sha256"], **counts})

    def _repair_best(self, state: dict) -> None:
        # rank 0 may have died between reporting a new best checkpoint and copying it to best/
        best_dir = storage.join(self.out_dir, "best")
        persisted = storage.join(self.out_dir, f"epoch_{state['epoch']:04d}")
        if state["best"] and state["best"]["epoch"] == state["epoch"] and storage.exists(persisted):
            current = checkpoints.latest_record(self.out_dir, best_dir)["best"]
            if current is None or current["epoch"] != state["epoch"]:
                checkpoints.copy_best(persisted, best_dir)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        self.train_loader.batch_sampler.set_epoch(epoch)
        window, epoch_sums = MetricSums(), MetricSums()
        t_window = t_fetch = time.perf_counter()
        for i, batch in enumerate(self.train_loader):
            wait_s = time.perf_counter() - t_fetch
            _maybe_kill(self.args.kill_at, self.out_dir, epoch, i, self.rank, self.world)
            lrs = current_lrs(self.optimizers)
            step_metrics = self.train_step(batch)
            self.step += 1
            for sums in (window, epoch_sums):
                sums.add(
                    step_metrics, tokens=batch_tokens(batch), wait_s=wait_s, bad_samples=float(batch["error_records"])
                )
            if self.step % self.cfg.train.log_every_steps == 0:
                self._log_window(window.reduce(), time.perf_counter() - t_window, epoch, lrs)
                window, t_window = MetricSums(), time.perf_counter()
            t_fetch = time.perf_counter()
        return epoch_sums.reduce()

    def run_epoch(self, epoch: int) -> tuple[dict[str, float], dict[str, float]]:
        return self.train_epoch(epoch), self.validate()

    def _log_window(self, sums: dict[str, float], elapsed_s: float, epoch: int, lrs: dict[str, float]) -> None:
        record = {
            "epoch": epoch,
            **summarize(sums, self.cfg.train.ttt_steps, "train_"),
            **lrs,
            "tokens_per_s": sums["tokens"] / elapsed_s,
            "data_wait_frac": sums["wait_s"] / (elapsed_s * self.world),
        }
        self.sinks.emit("train", self.step, record)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        sums = MetricSums()
        ks = acceptance.replay_lengths(self.cfg.evaluate.num_speculative_tokens, self.cfg.train.ttt_steps)
        tokens = self.cfg.evaluate.max_tokens  # the replay covers the response tokens evaluate decodes
        for batch in self.val_loader:
            tensors = to_device(batch, self.device)
            with self.autocast:
                draft, _loss, step_metrics = self.model(**tensors, **self.kwargs)
                targets = acceptance.target_ids(
                    self.raw, tensors["verifier_last_hidden_states"], tensors["input_ids"], tensors["document_ids"]
                )
                diag = acceptance.target_diagnostics(self.raw, draft, tensors, ks, tokens)  # why replay != acc_k
            replay = acceptance.replay_counts(draft, targets, tensors["loss_mask"], tensors["document_ids"], ks, tokens)
            sums.add(metric_tensors(step_metrics), bad_samples=float(batch["error_records"]), **replay, **diag)
        reduced = sums.reduce()
        return {
            **summarize(reduced, self.cfg.train.ttt_steps, "val_"),
            **acceptance.summarize(reduced, ks, max_tokens=tokens),
            **acceptance.diagnostics_summary(reduced, ks),
            "val_bad_samples": reduced["bad_samples"],
        }

    def end_epoch(self, epoch: int, train_sums: dict[str, float], val: dict[str, float]) -> None:
        tc = self.cfg.train
        record = {
            "epoch": epoch,
            **summarize(train_sums, tc.ttt_steps, "train_"),
            **val,
            "train_bad_samples": train_sums["bad_samples"],
            "train_tokens": train_sums["tokens"],
        }
        is_best = checkpoints.is_better(record[tc.best_metric], self.best and self.best["value"], tc.best_mode)
        if is_best:
            self.best = {"epoch": epoch, "value": record[tc.best_metric]}
        self.sinks.emit("validation", self.step, record)
        self.sinks.flush()
        state = {"epoch": epoch, "step": self.step, "metrics": record, "best": self.best, "config": self.args.cfg}
        with tempfile.TemporaryDirectory(prefix="eagle3-ckpt-") as tmp:
            checkpoint = None
            if self.rank == 0:
                checkpoints.save(tmp, self.raw, self.optimizers, self.schedulers, state, self.args.capture)
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(record, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{epoch:04d}")
        # report() returns once the files are uploaded, but the controller registers the checkpoint later; a worker
        # that died before that would restart from the previous epoch. Wait for registration on every rank.
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        if self.rank == 0 and is_best:
            checkpoints.copy_best(storage.join(self.out_dir, f"epoch_{epoch:04d}"), storage.join(self.out_dir, "best"))


def train_loop(config: dict) -> None:
    """Every worker's function, for both sources; online training passes its stream-reading Loop subclass."""
    loop = config.get("loop_cls", Loop)(config["args"])
    loop.restore()
    for epoch in range(loop.start_epoch, loop.cfg.train.epochs):
        train_sums, val = loop.run_epoch(epoch)
        loop.end_epoch(epoch, train_sums, val)
