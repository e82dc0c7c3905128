"""GRPO / RLOO's pre-flight check: every prompt record, as TRL tokenizes it, plus `max_completion_length` within the
model's positions, before the first generation (`core.fit.refuse_over_limit`, the check `prefixdpo train` runs on
its records).

TRL 1.16 neither truncates nor drops a long prompt (its `GRPOConfig` / `RLOOConfig` have no `max_prompt_length`):
it generates and trains on positions the model has no row for (a learned position table indexes past its end; a
rotary model was never trained there). So a record whose prompt + max_completion_length is over the positions is
refused in one line naming it, its numbers and the option to change. Completions never exceed
max_completion_length (TRL's tool-calling loop cuts tool results to stay within it), so this bound is the run's.

The sliding window is not checked here: a pass over rows longer than the window runs TRL's own layout
(`layout.why_not_shared`), which reproduces it. A streamed (iterable) dataset cannot be read twice and is not
checked; a processor's image tokens are counted as TRL's processor counts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prefixdpo.core.fit import model_limits, refuse_over_limit

__all__ = ["PROMPTS_PER_CALL", "prompt_lengths", "check_prompts_fit"]

PROMPTS_PER_CALL = 256  # prompts tokenized per call of the tokenizer


def _is_conversation(prompt) -> bool:
    """TRL's `is_conversational` for a prompt: a list of role/content messages."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def prompt_lengths(trainer, prompts: Sequence) -> list[int]:
    """Tokens of each prompt as TRL's `_tokenize_prompts` makes them for generation: text through the processing
    class, messages through its chat template with a generation prompt, TRL's tools, its training chat template
    (GRPO with tools) and `chat_template_kwargs` (tests/test_grpo_cli.py compares them with TRL's own)."""
    processing = trainer.processing_class
    kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
    tools, template = getattr(trainer, "tools", None), getattr(trainer, "chat_template", None)
    if tools:  # as GRPO passes them; RLOO has neither
        kwargs.update(tools=tools, chat_template=template)
    lengths: list[int] = []
    for start in range(0, len(prompts), PROMPTS_PER_CALL):
        chunk = list(prompts[start:start + PROMPTS_PER_CALL])
        if _is_conversation(chunk[0]):
            ids = processing.apply_chat_template(conversation=chunk, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **kwargs)["input_ids"]
        else:
            ids = processing(text=chunk)["input_ids"]
        lengths.extend(len(row) for row in ids)
    return lengths


def _named_datasets(train, evals) -> dict:
    """{name: dataset} of the datasets a run reads whole (an iterable one cannot be read twice: left out)."""
    named = {"train": train, **(dict(evals) if isinstance(evals, Mapping) else {"eval": evals})}
    return {name: data for name, data in named.items()
            if hasattr(data, "__len__") and len(data) and "prompt" in getattr(data, "column_names", ())}


def check_prompts_fit(trainer, record_indices=None) -> None:
    """Refuse, in one line, the first prompt record of the trainer's datasets whose prompt + max_completion_length
    is over the model's positions (module doc). record_indices: {dataset name: the source index of each of its rows}
    where rows are not the source's records (records skipped by `--invalid skip`); else row i is `record i`."""
    limits = model_limits(trainer.model, window=False)
    if not limits:
        return
    (limit, what), completion = limits[0], int(trainer.args.max_completion_length or 0)
    for name, data in _named_datasets(trainer.train_dataset, trainer.eval_dataset).items():
        lengths = prompt_lengths(trainer, data["prompt"])
        fits = limit - max(lengths)  # the max_completion_length every prompt of this dataset fits with
        if fits >= completion:
            continue
        rows = (record_indices or {}).get(name) or range(len(lengths))
        prefix = "" if name == "train" else f"{name}: "
        named = [(f"{prefix}record {row}", n + completion,
                  f"its prompt ({n} tokens) + max_completion_length ({completion})") for row, n in zip(rows, lengths)]
        advice = (f"set --max_completion_length {fits} or less, or shorten its prompt (TRL truncates no prompt)"
                  if fits >= 1 else f"shorten or remove the prompts of {limit} tokens or more (TRL truncates no "
                                    "prompt)")
        refuse_over_limit(named, (limit, what), advice)
