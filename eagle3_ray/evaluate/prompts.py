"""The evaluate stage's prompts: the held-out set (`evaluate.prompts`: one source or several), the check that none
was trained on, the run's own validation prompts, their token ids through the verifier's chat template, MT-Bench's
second turns, and the groups of prompts each concurrency level decodes together.

    prompts = load_prompts(cfg)                                   # [{"id", "messages", "category", "second_turn"}]
    token_prompts = tokenize_prompts(verifier_dir, prompts, trust_remote_code=False)
    groups = level_groups(prompts, concurrency, turns=(1,))       # waves never mix two groups
"""

from __future__ import annotations

import json
from typing import Any

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config, UserError
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.core.telemetry import log
from eagle3_ray.ingest import sources
from eagle3_ray.ingest.formats import conversation_id

STAGE = "evaluate"


def load_prompts(cfg: Config) -> list[dict[str, Any]]:
    """Held-out conversations `{"id", "messages", "category", "second_turn"}`: `evaluate.prompts` (JSONL or Parquet
    with `messages`, a `prompt` string or MT-Bench's `turns`, optionally `id` and `category`) or the builtin eval
    split; the first `evaluate.num_prompts` of each source, prompt turns only. With several sources a row without a
    `category` gets its source's name (`source_name`), so that the report compares the sources. `second_turn` is
    `turns[1]` when `evaluate.turns=both`, else None."""
    if cfg.evaluate.prompts is None:
        return _prompts_of(tiny_prompts(split="eval", seed=cfg.run.seed), "builtin:tiny_prompts(split=eval)", cfg)
    if isinstance(cfg.evaluate.prompts, str):
        return _prompts_of(_read_rows(cfg.evaluate.prompts), cfg.evaluate.prompts, cfg)
    return [
        {**p, "category": p["category"] or source_name(uri)}
        for uri in cfg.evaluate.prompts
        for p in _prompts_of(_read_rows(uri), uri, cfg)
    ]


def source_name(uri: str) -> str:
    """A prompt source's name: `builtin:humaneval` -> `humaneval`, `s3://b/evals/chat.jsonl` -> `chat`."""
    name = uri.removeprefix(sources.PREFIX).rstrip("/").rsplit("/", 1)[-1]
    return name.removesuffix(".jsonl").removesuffix(".parquet")


def _prompts_of(rows: list[dict[str, Any]], where: str, cfg: Config) -> list[dict[str, Any]]:
    """The first `evaluate.num_prompts` rows of one source as prompts."""
    if len(rows) < cfg.evaluate.num_prompts:
        raise ValueError(f"evaluate.num_prompts={cfg.evaluate.num_prompts} but {where} has {len(rows)} prompts")
    prompts = []
    for i, row in enumerate(rows[: cfg.evaluate.num_prompts]):
        first = row.get("prompt") or (row.get("turns") or [None])[0]
        messages = row.get("messages") or ([{"role": "user", "content": first}] if first else None)
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where} row {i}: needs `messages` ending with a user turn, a `prompt` or `turns`")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        second = None
        if cfg.evaluate.turns == "both":
            if len(row.get("turns") or []) < 2:
                raise ValueError(f"evaluate.turns=both: {where} row {i} has no second turn (`turns`: [first, second])")
            second = row["turns"][1]
        prompts.append(
            {
                "id": row.get("id") or conversation_id(messages),
                "messages": messages,
                "category": row.get("category"),
                "second_turn": second,
            }
        )
    return prompts


def _read_rows(uri: str) -> list[dict[str, Any]]:
    """Rows of one `evaluate.prompts` source. `builtin:mtbench|humaneval|tiny_prompts|sharegpt` come from the reader
    the ingest stage uses (ingest/sources.py): `{"id", "messages", "provenance": {package, version, file, row,
    record_id}}`, MT-Bench's also `"category"` and `"turns"` (every user turn; `messages` holds the first)."""
    if uri.startswith(sources.PREFIX):
        read = sources.read_builtin(uri, split="eval")
        if read.rejects:  # none in MT-Bench or HumanEval as shipped; said, never dropped silently
            log(STAGE, "prompt_rejects", source=uri, num_rejects=len(read.rejects), first=read.rejects[0]["detail"])
        return read.rows
    if uri.endswith(".parquet"):
        return storage.read_parquet(uri).to_pylist()
    if uri.endswith(".jsonl"):
        return [json.loads(line) for line in storage.read_bytes(uri).decode().splitlines() if line.strip()]
    raise UserError(f"evaluate.prompts={uri!r}: must be a .jsonl or .parquet file or builtin:<name>")


def training_conversations(training_data_dir: str) -> Any:
    """`id` and `messages` of the training data: `conversations.parquet` of the generate stage, or in online mode of
    the ingest stage."""
    return storage.read_parquet(storage.join(training_data_dir, "conversations.parquet"), columns=["id", "messages"])


def check_held_out(prompts: list[dict[str, Any]], training_data_dir: str, table: Any = None) -> dict[str, Any]:
    """Refuse prompts the drafter was trained on: same conversation id or same user text (a second turn included) as
    a row of the training data (`table`: training_conversations, read here when not given)."""
    uri = storage.join(training_data_dir, "conversations.parquet")
    table = training_conversations(training_data_dir) if table is None else table
    train_ids = set(table.column("id").to_pylist())
    train_texts = {m["content"] for msgs in table.column("messages").to_pylist() for m in msgs if m["role"] == "user"}
    overlap = [
        p["id"]
        for p in prompts
        if p["id"] in train_ids
        or any(m["content"] in train_texts for m in p["messages"] if m["role"] == "user")
        or p.get("second_turn") in train_texts
    ]
    if overlap:
        raise UserError(
            f"{len(overlap)} evaluation prompt(s) were in the training data ({uri}), e.g. ids "
            f"{overlap[:5]}: evaluate on held-out prompts"
        )
    return {"num_train_conversations": len(train_ids), "training_data": training_data_dir}


def validation_prompts(cfg: Config, training_data_dir: str, table: Any = None) -> list[dict[str, Any]]:
    """The first `evaluate.contract_prompts` conversations of the run's validation split (train/split.json, sorted
    ids), as prompts `{"id", "messages"}` up to their first user turn: training's replay estimate was computed on
    this split, so vLLM's acceptance on it checks the serving contract apart from any shift in the prompts.
    `table`: training_conversations, read here when not given."""
    if cfg.evaluate.contract_prompts == 0:
        return []
    split = storage.read_json(storage.join(stage.input_dir(cfg, "train"), "split.json"))
    wanted = split["val_ids"][: cfg.evaluate.contract_prompts]  # one (greedy) response per prompt: data.split_role
    table = training_conversations(training_data_dir) if table is None else table
    by_id = dict(zip(table.column("id").to_pylist(), table.column("messages").to_pylist(), strict=True))
    missing = [i for i in wanted if i not in by_id]
    if missing:
        raise ValueError(
            f"{len(missing)} validation id(s) of train/split.json are not in {training_data_dir}, e.g. {missing[:3]}: "
            "the training data changed after training"
        )
    prompts = []
    for i in wanted:
        messages = [{"role": m["role"], "content": m["content"]} for m in by_id[i]]
        first_user = next(j for j, m in enumerate(messages) if m["role"] == "user")
        prompts.append({"id": i, "messages": messages[: first_user + 1]})
    return prompts


def prompt_groups(
    prompts: list[dict[str, Any]], concurrency: int, *, turn: int = 1, offset: int = 0
) -> list[dict[str, Any]]:
    """Prompt indices (+ `offset`) to decode at `concurrency`, as `{"turn", "category", "indices"}` groups whose waves
    never mix two groups: one group per category (first-seen order) when every category holds at least `concurrency`
    prompts, so each category gets its own wall time and counters at full concurrency; else one group in prompt order
    (category None), as uncategorised prompts always are: MT-Bench's 10 per category cannot fill waves of 32."""
    by_category: dict[Any, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.get("category"), []).append(i + offset)
    if None in by_category or min(len(v) for v in by_category.values()) < concurrency:
        by_category = {None: [i + offset for i in range(len(prompts))]}
    return [{"turn": turn, "category": c, "indices": indices} for c, indices in by_category.items()]


def level_groups(prompts: list[dict[str, Any]], concurrency: int, turns: tuple[int, ...]) -> list[dict[str, Any]]:
    """`prompt_groups` for token prompts that hold every prompt once per turn in `turns`, turn after turn."""
    n = len(prompts)
    return [g for i, t in enumerate(turns) for g in prompt_groups(prompts, concurrency, turn=t, offset=i * n)]


def load_tokenizer(verifier_dir: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=trust_remote_code)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def tokenize_prompts(verifier_dir: str, prompts: list[dict[str, Any]], trust_remote_code: bool) -> list[list[int]]:
    """Each prompt's messages through the verifier's chat template, with the generation prompt: what vLLM decodes."""
    tokenizer = load_tokenizer(verifier_dir, trust_remote_code)
    return [chat_ids(tokenizer, p["messages"]) for p in prompts]


def second_turn_prompts(
    tokenizer: Any, prompts: list[dict[str, Any]], first_answers: list[list[int]]
) -> list[list[int]]:
    """MT-Bench's second turn: each conversation continued with the model's own first answer and the second user
    turn, `[...messages, assistant: answer, user: second_turn]`, through the verifier's chat template. The answer is
    decoded without special tokens (its end-of-turn token is the template's to write), as a chat client sends it
    back; an answer cut at `max_tokens` is sent as it is. Every engine decodes these same token ids."""
    return [
        chat_ids(
            tokenizer,
            [
                *p["messages"],
                {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": p["second_turn"]},
            ],
        )
        for p, answer in zip(prompts, first_answers, strict=True)
    ]


def check_second_turn_fits(tokenizer: Any, prompts: list[dict[str, Any]], cfg: Config) -> None:
    """Before any engine starts: a second turn holds the first prompt, an answer of up to `max_tokens` and the
    second user turn, then decodes `max_tokens` more; refuse prompts whose bound exceeds `verifier.max_model_len`."""
    empty = second_turn_prompts(tokenizer, prompts, [[] for _ in prompts])
    need = {p["id"]: len(ids) + 2 * cfg.evaluate.max_tokens for p, ids in zip(prompts, empty, strict=True)}
    too_long = {pid: n for pid, n in need.items() if n > cfg.verifier.max_model_len}
    if too_long:
        raise ValueError(
            f"evaluate.turns=both: {len(too_long)} prompt(s) need more than verifier.max_model_len="
            f"{cfg.verifier.max_model_len} tokens (first prompt, its answer and the second turn's, each answer up to "
            f"evaluate.max_tokens={cfg.evaluate.max_tokens}), e.g. {dict(list(too_long.items())[:3])}: raise "
            "verifier.max_model_len or lower evaluate.max_tokens"
        )
