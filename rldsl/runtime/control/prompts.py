"""The training prompts of a pipeline, as the rollout pump consumes them.

A dataset is one source or a weighted mixture of several (its plan options
``sources`` and ``weights``). Each next prompt comes from source i with
probability weight_i / sum(weights); each source goes through its own rows
epoch after epoch. Everything is drawn from RNGs seeded by the run's seed, so
a resumed run walks the same stream and skips what it already trained.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import random
from typing import Iterator

from rldsl.plan import PipelinePlan, truncates_long_prompts
from rldsl.runtime.protocols import PROMPT_TRUNCATED, Prompt

log = logging.getLogger(__name__)


def mixture(pipe: PipelinePlan) -> list[tuple[str, float]]:
    """(source, weight) of every source of the pipeline's dataset; the
    weights are relative. A plan without ``sources`` is its one ``source``."""
    from rldsl.tasks import DatasetError

    dataset = pipe.datasets[0]
    sources = list(dataset.options.get("sources") or [dataset.source])
    weights = dataset.options.get("weights") or [1.0] * len(sources)
    if len(weights) != len(sources):
        raise DatasetError(f"dataset {dataset.name!r}: {len(weights)} weights for {len(sources)} sources")
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise DatasetError(f"dataset {dataset.name!r}: weights must be >= 0 and not all 0, got {list(weights)}")
    return [(source, float(weight)) for source, weight in zip(sources, weights)]


def source_options(pipe: PipelinePlan, source: str, seed: int) -> dict:
    """The `load_dataset` options of one source: builtin tasks take the run's
    seed, jsonl files the dataset's field names."""
    if source.startswith("builtin:"):
        return {"seed": seed}
    options = pipe.datasets[0].options
    fields = {k: v for k, v in options.items() if k in ("prompt_field", "answer_field")}
    return {**fields, "hold_out": evaluates_from(pipe) == source}


def evaluates_from(pipe: PipelinePlan) -> str | None:
    """The training source the held-out prompts are split from: the first
    source, unless an `eval_source` is given or evaluation is off."""
    dataset = pipe.datasets[0]
    if dataset.options.get("eval_source") or not dataset.options.get("eval_size"):
        return None
    return dataset.source


def dataset_options(pipe: PipelinePlan, seed: int) -> dict:
    """``source_options`` of the dataset's first source."""
    return source_options(pipe, pipe.datasets[0].source, seed)


def load_source(pipe: PipelinePlan, source: str, split: str, seed: int) -> list[Prompt]:
    """The rows of one source of the pipeline's dataset; a source that cannot
    be read raises DatasetError naming the dataset and the source."""
    from rldsl.tasks import DatasetError, load_dataset

    try:
        rows = _templated(pipe, load_dataset(source, split, **source_options(pipe, source, seed)))
    except DatasetError as error:
        detail = str(error) if source.split(":", 1)[-1] in str(error) else f"{source}: {error}"
        raise DatasetError(f"dataset {pipe.datasets[0].name!r}: {detail}") from error
    kept, over = within_prompt_budget(pipe, rows)
    options = pipe.datasets[0].options
    if rows and not kept:
        raise DatasetError(f"dataset {pipe.datasets[0].name!r}: every {split} prompt of {source} is longer than "
                           f"max_prompt_tokens = {options['max_prompt_tokens']}; raise it")
    if over:
        truncates = truncates_long_prompts(options)
        fate = "truncated to it, their samples left out of the loss" if truncates else "dropped"
        log.warning("dataset %r: %d of %d %s prompts of %s are longer than max_prompt_tokens = %d and %s",
                    pipe.datasets[0].name, over, len(rows), split, source, options["max_prompt_tokens"], fate)
    return kept


def within_prompt_budget(pipe: PipelinePlan, prompts: list[Prompt]) -> tuple[list[Prompt], int]:
    """The prompts of at most the dataset's ``max_prompt_tokens`` tokens of
    the policy's tokenizer (after its chat template, as the engines encode
    them), and how many were longer: dropped (verl's
    ``filter_overlong_prompts``), or with ``long_prompts = truncate`` cut to
    the budget and marked so their samples train nothing (NeMo RL's
    ``max_input_seq_length``). All of them when the budget is 0."""
    budget = pipe.datasets[0].options.get("max_prompt_tokens", 0)
    if not budget:
        return prompts, 0
    from rldsl.models import load_tokenizer

    tokenizer = load_tokenizer(_policy_model(pipe).source)
    truncates = truncates_long_prompts(pipe.datasets[0].options)

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_bos=True))

    kept, over = [], 0
    for prompt in prompts:
        count = tokens(prompt.text)
        if count > budget:
            over += 1
            prompt = truncated_prompt(prompt, count, budget, tokens) if truncates else None
        if prompt is not None:
            kept.append(prompt)
    return kept, over


def truncated_prompt(prompt: Prompt, count: int, budget: int, tokens) -> Prompt | None:
    """The prompt cut to its longest start, in characters, of at most
    ``budget`` tokens (``tokens(text)`` counts them as the engines encode
    the text), its token count before in ``meta``; None when not even an
    empty start fits (a BOS over the budget)."""
    if tokens("") > budget:
        return None
    fits, too_long = 0, len(prompt.text)  # the start of `fits` characters fits, the whole text does not
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        fits, too_long = (middle, too_long) if tokens(prompt.text[:middle]) <= budget else (fits, middle)
    return dataclasses.replace(prompt, text=prompt.text[:fits], meta={**(prompt.meta or {}), PROMPT_TRUNCATED: count})


def _policy_model(pipe: PipelinePlan):
    return next(m for m in pipe.models if m.name == pipe.stage(pipe.batch.train_stage).model)


def _templated(pipe: PipelinePlan, prompts: list[Prompt]) -> list[Prompt]:
    """With the policy's `chat_template`, each prompt as the model's chat
    template writes it (every engine then encodes the same text): a string
    as one user turn, a row's chat messages (``meta["messages"]``) as they
    are. The text as written stays in ``meta["raw_prompt"]`` (for messages,
    the last user turn). Chat messages without a template are refused."""
    model = _templating_model(pipe)
    if model is None:
        untemplated = next((p for p in prompts if (p.meta or {}).get("messages")), None)
        if untemplated is not None:
            from rldsl.tasks import DatasetError

            where = f"{untemplated.meta.get('file', '?')}:{untemplated.meta.get('line', '?')}"
            raise DatasetError(_chat_messages_need_template(pipe, where))
        return prompts
    from rldsl.models import chat_formatter

    formatted = chat_formatter(model.source)
    return [dataclasses.replace(p, text=formatted((p.meta or {}).get("messages") or p.text),
                                meta={**(p.meta or {}), "raw_prompt": p.text}) for p in prompts]


def _templating_model(pipe: PipelinePlan):
    """The policy model when it has `chat_template`, else None (prompts stay as written)."""
    models = getattr(pipe, "models", None) or []  # a bare plan of datasets only (tests) has none
    if not any(m.chat_template for m in models):
        return None
    model = next((m for m in models if m.name == pipe.stage(pipe.batch.train_stage).model), None)
    return model if model is not None and model.chat_template else None


def _chat_messages_need_template(pipe: PipelinePlan, where: str) -> str:
    field = pipe.datasets[0].options.get("prompt_field", "prompt")
    models = getattr(pipe, "models", None) or []
    policy = next((m.name for m in models if m.name == pipe.stage(pipe.batch.train_stage).model), "policy")
    return (f"{where} holds a list of chat messages in `{field}`, which only a chat template turns into the "
            f"prompt's text; set `chat_template = true` on model `{policy}` (an `hf:` model whose tokenizer has a "
            "chat template), or point `prompt_field` at a string field")


def check_chat_prompts(pipe: PipelinePlan) -> None:
    """Before anything starts: a `jsonl:` source whose first row holds chat
    messages needs the policy's chat template (reading the rows checks every
    one later). Raises DatasetError naming the dataset, the row and the fix."""
    if _templating_model(pipe) is not None:
        return
    from rldsl.tasks import DatasetError, holds_messages

    dataset = pipe.datasets[0]
    field = dataset.options.get("prompt_field", "prompt")
    for source in [*(dataset.options.get("sources") or [dataset.source]), dataset.options.get("eval_source") or ""]:
        where = holds_messages(source, field)
        if where:
            raise DatasetError(f"dataset `{dataset.name}`: {_chat_messages_need_template(pipe, where)}")


def train_prompt_count(pipe: PipelinePlan, seed: int) -> int:
    """Train rows over every source drawn from: one epoch of the mixture."""
    return sum(len(load_source(pipe, source, "train", seed)) for source, weight in mixture(pipe) if weight > 0)


class _SourceCursor:
    """One source's rows, epoch after epoch, reshuffled each epoch when asked."""

    def __init__(self, source: str, rows: list[Prompt], shuffle_seed):
        self.source, self.rows, self.shuffle_seed = source, rows, shuffle_seed
        self.epoch, self.remaining = 0, self._epoch_stack(0)

    def _epoch_stack(self, epoch: int) -> list[int]:
        """The epoch's order of rows, last first: ``pop()`` walks it front to back."""
        order = list(range(len(self.rows)))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed(epoch)).shuffle(order)
        return order[::-1]

    def take(self) -> Prompt:
        if not self.remaining:
            self.epoch += 1
            self.remaining = self._epoch_stack(self.epoch)
        return self.rows[self.remaining.pop()]


def _shuffle_seed(seed: int, position: int, shuffle: bool):
    """The seed of each epoch's order of the source at ``position``. The first
    source keeps the seed a single-source dataset has always had, so such a
    stream is the same as before mixtures existed."""
    if not shuffle:
        return None
    if position == 0:
        return lambda epoch: seed + epoch
    return lambda epoch: f"mixture-{seed}-source-{position}-epoch-{epoch}"


def _source_choices(weights: list[float], seed: int) -> Iterator[int]:
    """Which source each next prompt comes from: i with probability weight_i."""
    drawn = [i for i, w in enumerate(weights) if w > 0]
    if len(drawn) == 1:  # no draws at all: a single source streams as it always has
        yield from itertools.repeat(drawn[0])
        return
    rng, bounds = random.Random(f"mixture-{seed}"), list(itertools.accumulate(weights))
    while True:  # bisect_right never picks a zero-weight source: its bound equals the previous one
        yield min(bisect.bisect_right(bounds, rng.random() * bounds[-1]), drawn[-1])


def prompt_stream(pipe: PipelinePlan, seed: int, trained_below: int = 0,
                  trained_above: frozenset[int] = frozenset()) -> Iterator[Prompt]:
    """The training prompts of the mixture, each with a unique, increasing
    index and its source in ``meta["source"]``. Indices already trained
    (below ``trained_below`` or in ``trained_above``) are skipped: a resumed
    run never trains a prompt twice."""
    shuffle = pipe.datasets[0].options.get("shuffle", True)
    sources = mixture(pipe)
    cursors = [_SourceCursor(source, load_source(pipe, source, "train", seed), _shuffle_seed(seed, i, shuffle))
               for i, (source, _) in enumerate(sources)]
    for index, choice in enumerate(_source_choices([w for _, w in sources], seed)):
        cursor = cursors[choice]
        row = cursor.take()
        if index >= trained_below and index not in trained_above:
            yield Prompt(index, row.text, row.answer, {**row.meta, "source": cursor.source})
