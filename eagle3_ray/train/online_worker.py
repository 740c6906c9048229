"""The train-worker side of online training: stream rows from `ray.train.get_dataset_shard("train")` become the
packed batches offline training builds, and train_worker.Loop's step, metrics and checkpoint code runs on them.

Per epoch (no cache, or the first epoch with `train.online_cache`):
    rows (online_engine.py) --from_row--> samples [T, A*H] / [T, H] (data.py's layout) --greedy pack in arrival
    order up to total_seq_len--> speculators' CollateFn --> batches [1, total_seq_len, ...]
Validation samples (by id hash, as offline) are evaluated as they stream past, with the model of that moment and no
gradient ("progressive" validation: offline validates after the epoch); they are never trained on.
Ranks receive different numbers of rows (the split keeps every row), so before each step the ranks agree whether
any of them still has a batch; a rank that has run out steps on an empty batch (all padding: no loss, zero
gradient) until every rank is done. Later epochs with the cache read its shards through the offline loaders.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import CollateFn
from speculators.train.recovery import SampleUnavailable

from eagle3_ray.core import packing, shards, storage
from eagle3_ray.core.telemetry import log
from eagle3_ray.generate.output import committed_samples
from eagle3_ray.train import acceptance, data
from eagle3_ray.train.online_engine import from_row
from eagle3_ray.train.worker import (
    Loop,
    MetricSums,
    WorkerArgs,
    collective_device,
    make_loaders,
    metric_tensors,
    summarize,
    to_device,
)


def stream_sample(row: dict, num_aux: int, dtype: torch.dtype) -> dict[str, torch.Tensor] | SampleUnavailable:
    """A stream row as one sample in speculators' BaseDataset layout (the same as data.ShardDataset's)."""
    hs = from_row(row)  # shape: [T, A + 1, H]
    if not torch.isfinite(hs).all():
        return SampleUnavailable(reason=f"stream sample {row['id']}: hidden states hold non-finite values")
    seq_len = hs.shape[0]
    return {
        "hidden_states": hs[:, :num_aux].flatten(1).to(dtype),  # shape: [T, A*H]
        "input_ids": torch.from_numpy(np.asarray(row["input_ids"], np.int64)),  # shape: [T]
        "verifier_last_hidden_states": hs[:, num_aux].to(dtype),  # shape: [T, H]
        "loss_mask": torch.from_numpy(np.asarray(row["loss_mask"], np.int64)),  # shape: [T]
        "lengths": torch.tensor([seq_len], dtype=torch.long),
        "position_ids": torch.arange(seq_len, dtype=torch.long),
    }


def _rows(stream):
    """Rows of this worker's shard; the next batches are fetched in the background while the model trains."""
    for batch in stream.iter_batches(batch_size=8, batch_format="numpy", prefetch_batches=2):
        for i in range(len(batch["id"])):
            yield {k: v[i] for k, v in batch.items()}


class Packer:
    """Stream samples packed greedily in arrival order up to `total_seq_len` (packing.GreedyPacker; a longer sample
    goes alone and CollateFn truncates it, as offline), each closed group collated into a batch."""

    def __init__(self, collate: CollateFn, total_seq_len: int):
        self.collate, self.packer = collate, packing.GreedyPacker(total_seq_len)

    @property
    def samples(self) -> list:
        return self.packer.items

    def add(self, sample) -> dict | None:
        seq_len = 0 if isinstance(sample, SampleUnavailable) else int(sample["lengths"][0])
        group = self.packer.add(sample, seq_len)
        return None if group is None else self.collate(group)

    def flush(self) -> dict:
        return self.collate(self.packer.flush())


class StreamBatches:
    """What Loop.train_epoch iterates in a streamed epoch: equalized train batches (looks like the offline loader:
    `batch_sampler.set_epoch` exists). Validation packs are evaluated inside, into `val_sums`."""

    def __init__(self, loop: OnlineLoop):
        self.loop = loop
        self.batch_sampler = self
        self.val_sums = MetricSums()

    def set_epoch(self, epoch: int) -> None:
        self.val_sums = MetricSums()

    def __iter__(self):
        packs = self._train_packs()
        while True:
            batch = next(packs, None)
            if not self._any_rank_has(batch is not None):
                return
            yield batch if batch is not None else self.loop.collate([])

    def _any_rank_has(self, has_batch: bool) -> bool:
        flag = torch.tensor([int(has_batch)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _train_packs(self):
        loop = self.loop
        train, val = Packer(loop.collate, loop.total_seq_len), Packer(loop.collate, loop.total_seq_len)
        num_rows = num_val_rows = 0
        for row in _rows(loop.stream):
            num_rows += 1
            sample = stream_sample(row, loop.num_aux, loop.dtype)
            if isinstance(sample, SampleUnavailable) and loop.cfg.train.on_bad_sample == "fail":
                raise data.BadSampleError(sample.reason)
            if row["id"] in loop.val_ids:
                num_val_rows += 1
                done = val.add(sample)
                if done is not None:
                    self._validate(done)
            elif (done := train.add(sample)) is not None:
                yield done
        if train.samples:
            yield train.flush()
        self._validate(val.flush())  # also when empty: every rank must hold the same metric keys
        # the epoch's row counts ride in the same cross-rank sum: the epoch record then says how many samples the
        # stream delivered (each sample once per epoch, also when an engine or its node was lost)
        self.val_sums.add({}, train_rows=float(num_rows - num_val_rows), val_rows=float(num_val_rows))
        log("train", "stream_done", rank=loop.rank, rows=num_rows, val_rows=num_val_rows)

    @torch.no_grad()
    def _validate(self, batch: dict) -> None:
        """The unwrapped model: ranks validate different numbers of packs, so no DDP collective may run here."""
        raw, cfg = self.loop.raw, self.loop.cfg
        raw.eval()
        tensors = to_device(batch, self.loop.device)
        ks = acceptance.replay_lengths(cfg.evaluate.num_speculative_tokens, cfg.train.ttt_steps)
        with self.loop.autocast:
            draft, _loss, step_metrics = raw(**tensors, **self.loop.kwargs)
            replay = acceptance.batch_replay_counts(raw, draft, tensors, ks, cfg.evaluate.max_tokens)
        self.val_sums.add(metric_tensors(step_metrics), bad_samples=float(batch["error_records"]), **replay)
        raw.train()


class OnlineLoop(Loop):
    """train_worker.Loop with the stream as its data: the same model, optimizer, restore, steps, metrics and
    checkpoints; the LR schedule's length is estimated (responses do not exist yet when it is built)."""

    def __init__(self, args: WorkerArgs):
        super().__init__(args)
        capture, tc = args.capture, self.cfg.train
        self.num_aux, self.total_seq_len = len(capture["aux_layer_ids"]), tc.total_seq_len
        self.dtype = torch.bfloat16 if tc.use_gpu else torch.float32
        self.collate = CollateFn(
            tc.total_seq_len,
            capture["hidden_size"],
            num_target_layers=self.num_aux,
            dtype=self.dtype,
            preprocess=shift_batch,
        )
        self.val_ids = set(args.val_ids)
        self.stream = ray.train.get_dataset_shard("train")  # a barrier: every rank asks for its shard here

    def run_epoch(self, epoch: int) -> tuple[dict[str, float], dict[str, float]]:
        cache = self.args.cache_dir
        source = "cache" if cache and epoch > 0 else "stream"
        if self.rank == 0:
            self.sinks.jsonl.write({"kind": "epoch_source", "epoch": epoch, "source": source})
        if source == "cache":
            if not isinstance(getattr(self, "val_loader", None), torch.utils.data.DataLoader):
                self.train_loader, self.val_loader = self._cache_loaders(cache)
            return self.train_epoch(epoch), self.validate()
        self.train_loader = StreamBatches(self)
        train_sums = self.train_epoch(epoch)
        val = self.train_loader.val_sums.reduce()
        ks = acceptance.replay_lengths(self.cfg.evaluate.num_speculative_tokens, self.cfg.train.ttt_steps)
        return train_sums, {
            **summarize(val, self.cfg.train.ttt_steps, "val_"),
            **acceptance.summarize(val, ks, max_tokens=self.cfg.evaluate.max_tokens),
            "val_bad_samples": val["bad_samples"],
            "train_samples": val["train_rows"],
            "val_samples": val["val_rows"],
        }

    def _cache_loaders(self, cache_dir: str):
        """Offline loaders over the first epoch's cache; rank 0 writes its manifest and conversations first."""
        if self.rank == 0 and not storage.exists(storage.join(cache_dir, "manifest.parquet")):
            finalise_cache(cache_dir)
        if dist.is_initialized():
            dist.barrier()
        refs, _manifest = data.load_refs(cache_dir)
        val_ids = self.val_ids
        args = dataclasses.replace(
            self.args,
            train_refs=[r for r in refs if r.id not in val_ids],
            val_refs=[r for r in refs if r.id in val_ids],
        )
        return make_loaders(self.cfg, args, self.rank, self.world)


def finalise_cache(cache_dir: str) -> int:
    """manifest.parquet + conversations.parquet of the cache from its committed parts (generate's layout)."""
    import pyarrow.compute as pc

    parts = committed_samples(cache_dir)
    ok = parts.filter(pc.equal(parts["status"], "ok"))
    storage.write_parquet_atomic(
        storage.join(cache_dir, "conversations.parquet"), ok.select(["id", "input_ids", "loss_mask"])
    )
    storage.write_parquet_atomic(
        storage.join(cache_dir, "manifest.parquet"),
        ok.select(shards.MANIFEST_SCHEMA.names).cast(shards.MANIFEST_SCHEMA),
    )
    log("train", "online_cache_ready", path=cache_dir, samples=ok.num_rows)
    return ok.num_rows
