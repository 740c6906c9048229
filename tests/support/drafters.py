"""Test drafters: a speculators EAGLE-3 drafter trained briefly on the tiny verifier's own greedy outputs, written as a
train-stage checkpoint directory (docs/stages.md: config.json, model.safetensors with trainable weights + d2t/t2d,
optimizer.pt, train_state.json, capture.json) plus a train/LATEST.json naming it.

Hidden states come from transformers (layer id k = `hidden_states[k]`, the final layer L read pre-norm from the input
of `model.norm`), which matches what vLLM captures (test_generate.py). 200 steps on 24 samples take about 15 s here.
"""

from __future__ import annotations

from pathlib import Path

import torch

NUM_TRAIN_PROMPTS = 12


def _greedy_samples(verifier_dir: str, prompts: list[list[dict]], max_new_tokens: int):
    """Yield (input_ids [T], loss_mask [T], layer hidden states [T, L+1, H] with layer L pre-norm) per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    captured = {}
    model.model.norm.register_forward_hook(lambda mod, args, out: captured.__setitem__("pre_norm", args[0]))
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        prompt_ids = torch.tensor([ids])
        with torch.no_grad():
            full = model.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False)
            out = model(full, output_hidden_states=True)
        layers = list(out.hidden_states[:-1]) + [captured["pre_norm"]]  # ids 0..L, id L before the final norm
        mask = torch.zeros(full.shape[1], dtype=torch.long)
        mask[prompt_ids.shape[1] :] = 1
        yield full[0], mask, torch.stack([h[0] for h in layers], dim=1)


def train_tiny_drafter(
    verifier_dir: str,
    run_dir: Path,
    *,
    aux_layer_ids=(1, 3, 4),
    num_steps: int = 200,
    draft_vocab_size: int = 1024,
    max_new_tokens: int = 32,
    seed: int = 0,
    num_epochs: int = 1,
) -> Path:
    """Train a drafter for `num_steps` per epoch (0: untrained), save one checkpoint per epoch with the project's
    checkpoints.save, write train/LATEST.json and a generate/ stand-in naming the training prompts. Returns the
    last checkpoint dir."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    from eagle3_ray.core.prompts import tiny_prompts

    torch.manual_seed(seed)
    vcfg = AutoConfig.from_pretrained(verifier_dir)
    num_layers = vcfg.num_hidden_layers
    conversations = tiny_prompts(split="train", num_prompts=NUM_TRAIN_PROMPTS, seed=seed)
    # an untrained drafter needs no data: its draft vocab is then simply the first ids
    samples = (
        list(_greedy_samples(verifier_dir, [c["messages"] for c in conversations], max_new_tokens)) if num_steps else []
    )
    freq: dict[int, int] = {}
    for ids, mask, _ in samples:
        for t in ids[mask.bool()].tolist():
            freq[t] = freq.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, vcfg.vocab_size)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_dir,
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[0],
    )
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=3,
        verifier_name_or_path=verifier_dir,
        target_layer_ids=list(aux_layer_ids),
        draft_attn_impl="sdpa",
    )
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=3, ttt_step_loss_decay=1.0
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    capture = capture_json(verifier_dir, aux_layer_ids, vcfg)
    for epoch in range(num_epochs):
        for step in range(num_steps):
            ids, mask, hs = samples[step % len(samples)]
            batch = shift_batch(
                {
                    "input_ids": ids,
                    "hidden_states": hs[:, list(aux_layer_ids)].flatten(1),
                    "verifier_last_hidden_states": hs[:, num_layers],
                    "loss_mask": mask,
                    "lengths": torch.tensor([len(ids)]),
                    "position_ids": torch.arange(len(ids)),
                }
            )
            batch = {k: v[None] for k, v in batch.items() if k != "lengths"}
            _, loss, _ = model(**batch, document_ids=torch.zeros_like(batch["input_ids"]), **train_kwargs)
            opt.zero_grad()
            loss.backward()
            opt.step()
        ckpt = write_checkpoint(
            model, opt, sched, Path(run_dir), capture, epoch=epoch, steps=num_steps, best=epoch == 0
        )
    write_generate_stub(Path(run_dir), conversations, capture)
    return ckpt


def capture_json(verifier_dir: str, aux_layer_ids, vcfg) -> dict:
    num_layers = vcfg.num_hidden_layers
    return {
        "aux_layer_ids": list(aux_layer_ids),
        "final_layer_id": num_layers,
        "layer_ids": [*aux_layer_ids, num_layers],
        "final_layer_norm": "pre",
        "hidden_size": vcfg.hidden_size,
        "num_hidden_layers": num_layers,
        "vocab_size": vcfg.vocab_size,
        "verifier_path": verifier_dir,
        "verifier_architectures": list(vcfg.architectures),
        "model_dtype": "bfloat16",
        "hidden_states_dtype": "bfloat16",
    }


def write_checkpoint(model, opt, sched, run_dir: Path, capture: dict, *, epoch: int, steps: int, best: bool) -> Path:
    """train/v-test/epoch_N in the train stage's format (a copy in best/ when `best`), and train/LATEST.json."""
    from eagle3_ray.core import storage
    from eagle3_ray.train import checkpoints

    train_dir = run_dir / "train" / "v-test"
    ckpt = train_dir / f"epoch_{epoch}"
    ckpt.mkdir(parents=True, exist_ok=True)
    metrics = {"val_acc_0": 0.1 * (epoch + 1)}
    checkpoints.save(str(ckpt), model, [opt], [sched], {"epoch": epoch, "step": steps, "metrics": metrics}, capture)
    if best:
        checkpoints.copy_best(str(ckpt), str(train_dir / "best"))
    record = checkpoints.latest_record(str(train_dir), str(train_dir / "best"))
    storage.write_json_atomic(str(train_dir / "summary.json"), {**record, "version": "v-test", "path": str(train_dir)})
    storage.mark_complete(str(train_dir), {"version": "v-test"})
    storage.set_latest(str(run_dir), "train", "v-test", record)
    return ckpt


def write_generate_stub(run_dir: Path, conversations: list[dict], capture: dict) -> None:
    """generate/v-test/{conversations.parquet, capture.json} + LATEST.json: what the evaluate stage reads to refuse
    prompts that were trained on."""
    import pyarrow as pa

    from eagle3_ray.core import storage
    from eagle3_ray.ingest.formats import conversation_id

    gen_dir = run_dir / "generate" / "v-test"
    gen_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"id": conversation_id(c["messages"]), "messages": c["messages"]} for c in conversations]
    storage.write_parquet_atomic(str(gen_dir / "conversations.parquet"), pa.Table.from_pylist(rows))
    storage.write_json_atomic(str(gen_dir / "capture.json"), capture)
    storage.write_json_atomic(str(gen_dir / "summary.json"), {"version": "v-test", "path": str(gen_dir)})
    storage.mark_complete(str(gen_dir), {"version": "v-test"})
    storage.set_latest(str(run_dir), "generate", "v-test")


def attach(cfg):
    """Make a stand-in run's generate/ and train/ outputs (v-test) the ones `cfg` determines: their version dirs
    become symlinks to v-test. Returns `cfg`."""
    from eagle3_ray.core import stage

    for name in ("generate", "train"):
        link = Path(stage.output_dir(cfg, name))
        if not link.exists():
            link.symlink_to("v-test", target_is_directory=True)  # relative: a copied run dir links to its own
    return cfg


def cached_run(tmp_path_factory, verifier_dir: str, name: str, **kwargs) -> Path:
    """A run dir holding a trained drafter (train/ + generate/ stand-in), built once per test session and shared by
    every test module that asks for the same `name`."""
    import json

    run_dir = tmp_path_factory.getbasetemp() / "drafter-runs" / name
    marker = run_dir / "built.json"
    if not marker.exists():
        train_tiny_drafter(verifier_dir, run_dir, **kwargs)
        marker.write_text(json.dumps(kwargs))
    return run_dir
