"""`prefixdpo verify --task grpo`: the prefix-shared log-prob pass of `PrefixGRPOTrainer` against TRL 1.16's own
`GRPOTrainer._get_per_token_logps_and_entropies` on the user's model.

One group batch, as TRL lays it out between generation and the loss: several prompts, each with G completions,
rows ``[left-padded prompt][right-padded completion]``, completions of very different lengths, some ending at EOS
(masked after it), some cut at the maximum completion length (no EOS), the rows shuffled (TRL shuffles between
generation and training, so a group's rows are not adjacent). Both passes run on the same trainer, model and
rows: ours on prefixdpo's attention, TRL's on the model's stock attention (`prefixdpo.core.verify.stock_attention`).
Compared: per-token log-probs, per-token entropies, and the gradients of a fixed random weighted sum of both.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from dataclasses import dataclass

import torch

from prefixdpo.data.loading import read_tab_groups
from prefixdpo.errors import UserError

from prefixdpo.core.verify import stock_attention

# Three prompts of different lengths (left padding), four completions each, from a few words to a paragraph: with
# the default cut (the 75th percentile of completion lengths) the longest ones are truncated, the rest end at EOS.
DEFAULT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("System: answer briefly and show your reasoning.\nQuestion: a train leaves at 9:00 and travels 120 km at "
     "80 km/h. When does it arrive?\nAnswer:",
     (" At 10:30.",
      " It needs 120 / 80 = 1.5 hours, so it arrives at 10:30.",
      " The distance is 120 km and the speed is 80 km/h. Time = distance / speed = 1.5 h. Starting at 9:00 and "
      "adding one hour and thirty minutes gives 10:30, which is the arrival time.",
      " 10:30")),
    ("Summarise: the committee met on Tuesday to review the budget and agreed to fund the library first.",
     (" The library gets funded first.",
      " On Tuesday the committee reviewed the budget. After a long discussion about priorities it agreed that "
      "the library would be funded before anything else, and postponed the other items to the next meeting.",
      " Budget review: library first.",
      " They met.")),
    ("Write one sentence about a lighthouse keeper.",
     (" He kept the light burning for forty years.",
      " Every night the keeper climbed the stairs, trimmed the wick and watched the ships pass safely by.",
      " She found a message in a bottle.",
      " The keeper, who had not spoken to anyone for months, opened the door to a stranger soaked by the storm "
      "and offered him tea, a blanket and the only chair in the tower.")),
)


@dataclass
class GroupRows:
    """TRL's rows of one group batch.

    input_ids, attention_mask: [N, L] ``[left-padded prompt][right-padded completion]``; logits_to_keep: K (the
    completion columns); ends_at_eos: [N] bool, the completion ends with EOS (False: cut at K); groups: prompts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    ends_at_eos: torch.Tensor
    groups: int

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def with_truncated_masked(self) -> torch.Tensor:
        """The attention mask TRL builds under `mask_truncated_completions`: cut completions fully masked."""
        mask = self.attention_mask.clone()
        mask[~self.ends_at_eos, -self.logits_to_keep:] = 0
        return mask

    def describe(self) -> str:
        K = self.logits_to_keep
        prompts = self.attention_mask[:, :-K].sum(1)
        completions = self.attention_mask[:, -K:].sum(1)
        eos = int(self.ends_at_eos.sum())
        return (f"{self.groups} prompts ({int(prompts.min())}-{int(prompts.max())} tokens, left-padded), "
                f"{self.num_rows} completions ({int(completions.min())}-{int(completions.max())} tokens; {eos} end at "
                f"EOS, {self.num_rows - eos} cut at max length {K}), rows shuffled")


def group_rows(tokenizer, groups=DEFAULT_GROUPS, *, max_completion_length: int | None = None,
               seed: int = 0) -> GroupRows:
    """TRL's rows for `groups` ((prompt text, completion texts), ...) tokenized by `tokenizer` (`rows_of_ids`);
    prompts get the tokenizer's BOS first where it has one."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no EOS token: GRPO completions end at EOS (TRL's rule)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return rows_of_ids([bos + encode(prompt) for prompt, _ in groups],
                       [[encode(c) for c in texts] for _, texts in groups],
                       eos=eos, pad=pad, max_completion_length=max_completion_length, seed=seed)


def rows_of_ids(prompts: list[list[int]], completions: list[list[list[int]]], *, eos: int, pad: int,
                max_completion_length: int | None = None, seed: int = 0) -> GroupRows:
    """TRL's rows of prompts (token ids) and each prompt's completions (token ids, without EOS).

    A completion longer than `max_completion_length` (default: the 75th percentile of the completions' lengths
    with EOS, so some are cut and most are not) is cut there without EOS, as generation stops at the limit; a
    shorter one ends with `eos`. The rows are shuffled (seeded).
    """
    lengths = sorted(len(c) + 1 for group in completions for c in group)
    K = max_completion_length or lengths[(3 * len(lengths)) // 4]
    P = max(len(p) for p in prompts)
    rows, masks, eos_flags = [], [], []
    for prompt, group in zip(prompts, completions):
        for ids in group:
            ends = len(ids) + 1 <= K
            completion = ids + [eos] if ends else ids[:K]
            rows.append([pad] * (P - len(prompt)) + prompt + completion + [pad] * (K - len(completion)))
            masks.append([0] * (P - len(prompt)) + [1] * len(prompt) + [1] * len(completion)
                         + [0] * (K - len(completion)))
            eos_flags.append(ends)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return GroupRows(torch.tensor(rows)[order], torch.tensor(masks)[order], K, torch.tensor(eos_flags)[order],
                     len(prompts))


def random_group_rows(vocab_size: int, *, eos: int, pad: int, seed: int = 0) -> GroupRows:
    """Rows of random tokens (ids >= 5, not `eos`) in the shape `DEFAULT_GROUPS` has: 3 prompts of 20, 7 and 13
    tokens, 4 completions each of 1 to 40 tokens, the longest cut at the maximum length."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return [t if t != eos else 5 for t in torch.randint(5, vocab_size, (n,), generator=g).tolist()]

    shapes = ((20, (3, 17, 40, 1)), (7, (9, 33, 5, 2)), (13, (12, 1, 26, 40)))
    return rows_of_ids([ids(p) for p, _ in shapes], [[ids(n) for n in cs] for _, cs in shapes], eos=eos, pad=pad,
                       seed=seed)


def read_groups(path: str) -> list[tuple[str, list[str]]]:
    """Groups from a file of lines 'prompt<TAB>completion<TAB>completion...' (at least 2 completions each)."""
    return read_tab_groups(path, "completions")


@dataclass
class GroupVerifyResult:
    """Max |ours - TRL's| of one case; scales are TRL's largest |value| (relative tolerances use max(1, scale))."""

    case: str
    logp_diff: float
    logp_scale: float
    entropy_diff: float
    entropy_scale: float
    grad_diff: float
    grad_scale: float
    tokens_shared: int  # real tokens the prefix-shared lines ran
    tokens_trl: int  # real tokens of TRL's rows

    def ok(self, logp_tol: float, grad_tol: float) -> bool:
        return (self.logp_diff <= logp_tol * max(1.0, self.logp_scale)
                and self.entropy_diff <= logp_tol * max(1.0, self.entropy_scale)
                and self.grad_diff <= grad_tol * max(1.0, self.grad_scale))


def zero_reward(completions, **kwargs) -> list[float]:
    """A reward TRL's trainer can be built with where no generation runs (verify, bench)."""
    return [0.0] * len(completions)


def build_verify_trainer(model, tokenizer, backend: str, output_dir: str, *, max_completion_length: int):
    """A `PrefixGRPOTrainer` over `model` (eval mode: no dropout) whose passes run on `backend`; TRL's defaults
    otherwise (temperature 1, no reference); computing in the model's own dtype (no autocast).

    max_completion_length: the completion columns of the rows it will compare (`GroupRows.logits_to_keep`); it
    generates nothing, but its pre-flight check holds its placeholder prompts + this length to the model's
    positions, as a run's (TRL's default, 512, is a whole tiny model's positions)."""
    from datasets import Dataset

    from prefixdpo.grpo.config import PrefixGRPOConfig
    from prefixdpo.grpo.trainer import PrefixGRPOTrainer

    device = next(model.parameters()).device
    args = PrefixGRPOConfig(output_dir=output_dir, per_device_train_batch_size=2, num_generations=2,
                            use_cpu=device.type == "cpu", bf16=False, report_to="none", save_strategy="no",
                            gradient_checkpointing=False, attention=backend, disable_tqdm=True,
                            max_completion_length=max_completion_length)
    trainer = PrefixGRPOTrainer(model=model, reward_funcs=zero_reward, args=args,
                                train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer)
    trainer.model.train(False)
    return trainer


@contextlib.contextmanager
def pass_layout(trainer, *, packing: bool):
    """The trainer's passes with `packing` on or off for the duration (its settings are restored after)."""
    previous = trainer.group_settings.packing
    trainer.change_settings(packing=packing)
    try:
        yield trainer
    finally:
        trainer.change_settings(packing=previous)


def _values_and_grads(run_pass, model, weights: torch.Tensor):
    """(log-probs [N, K], entropies [N, K], flat gradient of sum(w0 * logps + w1 * entropies))."""
    model.zero_grad(set_to_none=True)
    logps, entropies, _ = run_pass()
    ((logps.float() * weights[0]).sum() + (entropies.float() * weights[1]).sum()).backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return logps.detach().float(), entropies.detach().float(), grads


def compare_group_pass(trainer, rows: GroupRows, *, case: str, packing: bool = True, batch_size: int | None = None,
                       mask_truncated: bool = False, seed: int = 0) -> GroupVerifyResult:
    """Our pass vs `GRPOTrainer._get_per_token_logps_and_entropies` (TRL's, stock attention) on `rows`.

    packing: groups packed into shared lines (else one line per prompt); batch_size: TRL's rows per forward (ours
    runs at most as many line slots per forward); mask_truncated: TRL's `mask_truncated_completions` mask.
    """
    from trl import GRPOTrainer

    from prefixdpo.grpo.layout import layout_groups

    model = trainer.model
    device = next(model.parameters()).device
    mask = rows.with_truncated_masked() if mask_truncated else rows.attention_mask
    call = dict(input_ids=rows.input_ids.to(device), attention_mask=mask.to(device),
                logits_to_keep=rows.logits_to_keep, batch_size=batch_size, compute_entropy=True)
    weights = torch.randn(2, rows.num_rows, rows.logits_to_keep, generator=torch.Generator().manual_seed(seed))
    weights = weights.to(device)

    def ours():
        with pass_layout(trainer, packing=packing):
            return trainer._get_per_token_logps_and_entropies(model, **call)

    def theirs():
        with stock_attention(model):
            return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, **call)

    logps, entropies, grads = _values_and_grads(ours, model, weights)
    ref_logps, ref_entropies, ref_grads = _values_and_grads(theirs, model, weights)
    lines = layout_groups(rows.input_ids, mask, rows.logits_to_keep, packing=packing)
    return GroupVerifyResult(
        case=case,
        logp_diff=float((logps - ref_logps).abs().max()), logp_scale=float(ref_logps.abs().max()),
        entropy_diff=float((entropies - ref_entropies).abs().max()), entropy_scale=float(ref_entropies.abs().max()),
        grad_diff=float((grads - ref_grads).abs().max()), grad_scale=float(ref_grads.abs().max()),
        tokens_shared=lines.num_real_tokens, tokens_trl=lines.trl_tokens,
    )


def verify_cases(rows: GroupRows) -> list[tuple[str, dict]]:
    """(name, `compare_group_pass` options) of every case `prefixdpo verify --task grpo` runs."""
    chunk = max(1, rows.num_rows // 3)
    return [
        ("packed lines, one forward", dict(packing=True)),
        ("one line per prompt", dict(packing=False)),
        (f"TRL's chunks of {chunk} rows per forward", dict(packing=True, batch_size=chunk)),
        ("cut completions masked (TRL option)", dict(packing=True, mask_truncated=True)),
    ]


def run_group_verify(model, tokenizer, backend: str, rows: GroupRows) -> list[GroupVerifyResult]:
    """Every case of `verify_cases` on a verify trainer over `model` (in a temporary output folder)."""
    with tempfile.TemporaryDirectory(prefix="prefixdpo-verify-grpo-") as tmp:
        trainer = build_verify_trainer(model, tokenizer, backend, tmp, max_completion_length=rows.logits_to_keep)
        return [compare_group_pass(trainer, rows, case=name, **options) for name, options in verify_cases(rows)]
