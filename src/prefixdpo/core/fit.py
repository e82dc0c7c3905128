"""Does the data fit the model and the machine? Checked once, after the examples are prepared and the model
and attention backend are known, before any training work (nothing written, no reference pass).

Two limits, each refused in one line that names the record (its source index, as the data report names
records) and a `max_length` that fits:

- **positions.** Responses restart their positions after the prompt (`data/layout.py`), so the largest
  position id of an example is `len(prompt) + len(longest response) - 1`, whatever the packing. It must be
  below the model's `max_position_embeddings` (a learned position table has no row beyond it; a rotary
  model was never trained there), and within a sliding window, which the prefix-sharing rule does not
  reproduce over a shared row (`forward.check_sequences_fit_window`, checked here for the whole dataset
  instead of per batch). Rope scaling extends the limit (`position_limit`); a model whose config states no
  limit is not checked.
- **memory of the attention mask.** `sdpa` builds a dense bool mask `[B, 1, L, L]` per micro-batch of B
  lines of L tokens; `segmented` builds `[S, 1, Lq, Lk]` masks over its segments; `flex` (a BlockMask of
  `[B, 1, L/128, L/128]` blocks) and `varlen` (no mask) have no tensor quadratic in the line. The estimate of the
  largest micro-batch's mask path (`mask_bytes`) must stay within half the memory of the device (a CPU's
  RAM shared by the processes of this node, or one GPU's memory; `memory_bound`): a 1,000,000-character
  prompt otherwise asks for tens of GB at its first forward.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixdpo.core.attention.backends import WINDOWED_BACKENDS
from prefixdpo.data.example import Example
from prefixdpo.data.loader import LoaderSettings, resolve_pack_length, row_length
from prefixdpo.data.loader import _check_rows_fit as check_rows_fit  # the loader's own message, met earlier
from prefixdpo.errors import UserError
from prefixdpo.core.model_checks import base_model, sliding_window_of, text_config
from prefixdpo.core.stock_attention import on_stock_route

__all__ = ["DataDoesNotFitError", "position_limit", "model_limits", "refuse_over_limit", "check_positions", "mask_bytes", "memory_bound",
           "check_mask_memory", "FitSettings", "check_run_fits", "activation_bytes_per_token", "auto_tokens_per_pass",
           "block_activation_bytes"]

_NO_LIMIT_ROPE = {"dynamic"}  # dynamic NTK scaling stretches itself to any length at run time
_SEGMENT_WASTE = 1.25  # segmented attention pads a group by at most 25% of its real cells (`segments._group`)


class DataDoesNotFitError(UserError):
    """A record longer than the model's positions, or a batch whose attention mask would not fit in memory."""


def longest_sequence(example: Example) -> int:
    """Tokens of the example's longest `[prompt][response]` sequence: its largest position id + 1."""
    return len(example.prompt_ids) + max(len(r) for r in example.response_ids)


def _where(example: Example, i: int, name: str) -> str:
    """How a message names an example: `record N` (its source index), prefixed by a dataset other than train."""
    where = f"record {example.source_index}" if example.source_index >= 0 else f"example {i}"
    return where if name == "train" else f"{name}: {where}"


# ---- positions ------------------------------------------------------------------------------------------


def _rope_parameters(cfg) -> list[dict]:
    """The config's rope parameter dicts (one, or one per layer type); [] without rope scaling information."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(rope, Mapping):
        return []
    nested = [v for v in rope.values() if isinstance(v, Mapping)]
    return nested or [rope]


def position_limit(model) -> int | None:
    """Positions the model was built for: `max_position_embeddings` (GPT-2's `n_positions` through its
    attribute map), extended by rope scaling to `original_max_position_embeddings x factor` where that is
    larger (YaRN, linear); None where the config states none or the scaling has no fixed end (dynamic NTK).
    Llama-3 and LongRoPE configs already state the extended length in `max_position_embeddings`."""
    cfg = text_config(base_model(model))
    limit = getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        return None
    for rope in _rope_parameters(cfg):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in _NO_LIMIT_ROPE:
            return None
        factor = rope.get("factor")
        if kind != "default" and isinstance(factor, (int, float)) and factor > 1:
            original = rope.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", None) or limit
            limit = max(limit, int(original * factor))
    return limit


def model_limits(model, *, window: bool = True) -> list[tuple[int, str]]:
    """(tokens, what they are, for messages) of each limit a sequence through `model` must stay within: its
    positions (`position_limit`) and, with `window`, its sliding window (a prefix-shared row does not reproduce it)."""
    hf = base_model(model)
    limits = []
    positions = position_limit(model)
    if positions is not None:
        limits.append((positions, f"the {positions} positions of {type(hf).__name__} (max_position_embeddings)"))
    # a model on its own attention (`core.stock_attention`, prefix sharing off) slides its window itself
    size = sliding_window_of(hf) if window and not on_stock_route(hf) else None
    if size is not None:
        limits.append((size, f"the sliding-window attention of {type(hf).__name__} (window {size}), which this "
                             "attention backend does not slide over a shared row (--attention sdpa, flex or segmented "
                             "do)"))
    return limits


def refuse_over_limit(named_lengths: Sequence[tuple[str, int, str]], limit: tuple[int, str], advice: str) -> None:
    """The one pre-flight check of every command's records against the model (`model_limits`): refuse the first
    record whose longest sequence is over `limit`, in one line naming it, its tokens, how many more are over, and
    `advice` (the option to change). named_lengths: per record, (its name, the tokens of its longest sequence, what
    makes them, e.g. "its prompt + longest response")."""
    tokens, what = limit
    over = [(name, n, line) for name, n, line in named_lengths if n > tokens]
    if not over:
        return
    name, n, line = over[0]
    more = f" ({len(over) - 1} more records are over too)" if len(over) > 1 else ""
    raise DataDoesNotFitError(f"{name}: {line} is {n} tokens, more than {what}{more}: {advice}")


def check_positions(model, examples: Sequence[Example], name: str = "train", backend: str | None = None) -> None:
    """Refuse the first example whose longest `[prompt][response]` sequence is over the model's positions or, on a
    `backend` that does not slide the window over a shared row (`backends.WINDOWED_BACKENDS`; None: any), its sliding
    window, naming it, how many more are over, and the `max_length` that fits."""
    limits = model_limits(model, window=backend not in WINDOWED_BACKENDS)
    if not limits:
        return
    limit = min(limits)
    named = [(_where(ex, i, name), longest_sequence(ex), "its prompt + longest response")
             for i, ex in enumerate(examples)]
    refuse_over_limit(named, limit, f"set --max_length {limit[0]} or less")


# ---- memory of the attention mask ----------------------------------------------------------------------


@dataclass(frozen=True)
class Batches:
    """How one pass cuts a dataset into micro-batches: `lines` per micro-batch, packed into `pack_length`
    lines or one example per line (`prefix_sharing` as the loader lays them out), padded to `pad_multiple`."""

    what: str  # e.g. "training", for messages
    batch_option: str  # the option that sets `lines`
    lines: int
    packing: bool = False
    pack_length: int | None = None
    prefix_sharing: bool = True
    pad_multiple: int = 1

    @classmethod
    def of(cls, settings: LoaderSettings, what: str, batch_option: str) -> "Batches":
        return cls(what, batch_option, settings.batch_size, settings.packing, settings.pack_length,
                   settings.prefix_sharing, settings.pad_multiple)


def _longest_line(examples: Sequence[Example], batches: Batches) -> tuple[int, int]:
    """(tokens of the longest line of any micro-batch, index of the example that makes it that long)."""
    lengths = [row_length(ex, batches.prefix_sharing) for ex in examples]
    longest = max(range(len(examples)), key=lengths.__getitem__)
    if batches.packing:
        settings = LoaderSettings(packing=True, pack_length=batches.pack_length, prefix_sharing=batches.prefix_sharing)
        return resolve_pack_length(examples, settings), longest
    m = batches.pad_multiple
    return -(-lengths[longest] // m) * m, longest


def mask_bytes(backend: str, lines: int, line_length: int, longest_sequence: int, itemsize: int) -> int:
    """Estimated peak bytes of the attention-mask path of one micro-batch of `lines` lines of `line_length`
    tokens, whose longest `[prompt][response]` sequence has `longest_sequence` tokens; 0 where the backend
    builds no mask quadratic in the line. itemsize: bytes per element of the compute dtype.

    sdpa: building the bool `[B, 1, L, L]` mask holds about four `[B, L, L]` bool tensors at once, and SDPA
    adds a float copy of the mask in the compute dtype next to the bool one (both measured on CPU, torch
    2.13: L = 8192 -> 258 MB to build, +265 MB in SDPA for fp32): `B L^2 max(4, 1 + itemsize)`.
    segmented: a line's segments hold at most `longest_sequence x L` query-key cells (each segment's keys
    are at most one sequence, its queries part of the line), padded by at most 25% per group; a bool mask
    plus SDPA's float copy per cell.
    """
    if backend == "sdpa":
        return lines * line_length * line_length * max(4, 1 + itemsize)
    if backend == "segmented":
        return math.ceil(_SEGMENT_WASTE * lines * longest_sequence * line_length) * (1 + itemsize)
    return 0


def _cgroup_memory_limit() -> int | None:
    """The container's memory limit (cgroup v2 or v1), if it sets one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            return int(text)
    return None


def memory_bound(device) -> tuple[int, str] | None:
    """(bytes the mask path of one micro-batch may take, how that was decided): half of one GPU's memory, or
    half of this machine's RAM (the container's limit where lower) shared by the node's processes; None
    where the machine does not say how much memory it has.

    Total rather than free memory: every rank of a run must decide the same way, and free memory differs
    from moment to moment and rank to rank. Half: the model, its gradients and activations need the rest.
    """
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total // 2, f"half of the {_size(total)} of {torch.cuda.get_device_name(device)}"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to compare with
        return None
    total = min(total, _cgroup_memory_limit() or total)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    shared = f" shared by {ranks} processes" if ranks > 1 else ""
    return total // 2 // ranks, f"half of this machine's {_size(total)} of memory{shared}"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _fitting_line(backend: str, budget: int, lines: int, itemsize: int, longest_sequence: int) -> int:
    """The longest line whose micro-batch of `lines` lines fits `budget` bytes (`mask_bytes` solved for L)."""
    if backend == "sdpa":
        return math.isqrt(budget // (lines * max(4, 1 + itemsize)))
    return int(budget / (_SEGMENT_WASTE * lines * longest_sequence * (1 + itemsize)))


def _fitting_max_length(backend: str, budget: int, lines: int, itemsize: int, responses: int) -> int:
    """The largest `max_length` m whose worst line fits `budget` bytes: each `[prompt][response]` sequence holds
    at most m tokens, so one example's line holds at most K x m (K responses; a long prompt: about m)."""
    if backend == "sdpa":
        return _fitting_line(backend, budget, lines, itemsize, 0) // responses
    return math.isqrt(int(budget / (_SEGMENT_WASTE * lines * responses * (1 + itemsize))))


def check_mask_memory(examples: Sequence[Example], batches: Batches, *, backend: str, itemsize: int,
                      bound: tuple[int, str] | None, name: str = "train") -> None:
    """Refuse a dataset whose largest micro-batch's attention mask (`mask_bytes`) is over `bound`
    (`memory_bound`), naming the record that makes the longest line (or the pack_length that sets it) and
    what would fit."""
    if backend not in ("sdpa", "segmented") or not examples or bound is None:
        return
    budget, budget_text = bound
    line, i = _longest_line(examples, batches)
    lines = min(batches.lines, len(examples))
    longest = min(line, max(longest_sequence(ex) for ex in examples))
    need = mask_bytes(backend, lines, line, longest, itemsize)
    if need <= budget:
        return
    ex = examples[i]
    if batches.packing and batches.pack_length is not None:  # the option sets the line, not a record
        subject = f"pack_length={line}:"
        fitting = _fitting_line(backend, budget, lines, itemsize, longest) // 128 * 128
        advice = [f"set --pack_length {fitting} or less"] if fitting >= longest else []
    else:
        subject = f"{_where(ex, i, name)} makes a line of {line} tokens:"
        fitting = _fitting_max_length(backend, budget, lines, itemsize, ex.num_responses)
        advice = [f"set --max_length {fitting} or less"] if fitting >= 1 else []
    if lines > 1:
        advice.append(f"a smaller --{batches.batch_option} (now {batches.lines})")
    if backend == "sdpa" and mask_bytes("segmented", lines, line, longest, itemsize) <= budget:
        advice.append("--attention segmented, which masks only each segment")
    raise DataDoesNotFitError(
        f"{subject} {batches.what} micro-batches of {lines} such lines need about {_size(need)} for "
        f"attention={backend}'s mask, more than {budget_text}: " + ", or ".join(advice or ["use a bigger machine"]))


# ---- activations: the budget of one pass (prefix reuse) -------------------------------------------------


def activation_bytes_per_token(model, itemsize: int) -> int:
    """Estimated bytes of activations one token keeps for backward in one forward of `model` (linear in tokens;
    the attention mask's memory is `mask_bytes`): per layer, a Llama-shaped block's saved tensors, the two norms'
    inputs and outputs (4 h), the query, key and value projections (h + 2 kv), the attention and output
    projections' outputs (2 h), the residual (h), the MLP's gate, up and activation (3 i) and its output (h), with
    h the hidden size, kv the key/value width, i the MLP width; x itemsize. An estimate, for budgets and `inspect`:
    other architectures keep somewhat more or less."""
    cfg = text_config(base_model(model))
    h = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0))
    i = int(getattr(cfg, "intermediate_size", 0) or getattr(cfg, "n_inner", None) or 4 * h)
    heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 1))
    kv = h * int(getattr(cfg, "num_key_value_heads", heads) or heads) // max(heads, 1)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 1))
    return block_activation_bytes(h, i, kv, layers, itemsize)


def block_activation_bytes(hidden: int, intermediate: int, kv_width: int, layers: int, itemsize: int) -> int:
    """`activation_bytes_per_token` from the dimensions: layers x (9 hidden + 2 kv_width + 3 intermediate) x
    itemsize."""
    return layers * (9 * hidden + 2 * kv_width + 3 * intermediate) * itemsize


def auto_tokens_per_pass(model, device, itemsize: int) -> int:
    """The most tokens one training pass may hold on `device`: half of what `memory_bound` leaves the mask path
    (the other half: the prefix's activations, the weights' gradients and the optimizer), at
    `activation_bytes_per_token` each; at least 128. A machine that does not say its memory: 8192."""
    bound = memory_bound(device)
    if bound is None:
        return 8192
    return max(128, bound[0] // 2 // max(activation_bytes_per_token(model, itemsize), 1))


# ---- a trainer's run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitSettings:
    """What the fit check reads of a run, built once from its config (`training.settings.fit_settings`).

    train, eval:    the loader settings of training and evaluation micro-batches (`batch_size`: their lines)
    backend:        the attention backend every pass runs
    device:         where the passes run (its memory bounds the mask: `memory_bound`)
    half_precision: attention computes in bf16/fp16 (autocast), whatever the model's dtype
    extra_passes:   further passes over every dataset with micro-batches of their own (e.g. a method's no-grad
                    precompute before training)
    """

    train: LoaderSettings
    eval: LoaderSettings
    backend: str
    device: Any = "cpu"
    half_precision: bool = False
    extra_passes: tuple[Batches, ...] = ()


def _compute_itemsize(model, half_precision: bool) -> int:
    """Bytes per element of the dtype attention computes in: half precision under --bf16/--fp16 autocast."""
    if half_precision:
        return 2
    return torch.finfo(base_model(model).dtype).bits // 8


def check_run_fits(model, settings: FitSettings, train, evals) -> None:
    """Every dataset a trainer will run (train; eval, or a dict of them) against the model's positions and,
    for the micro-batches of training, evaluation and any extra pass, the memory of the mask."""
    named = {"train": train, **(dict(evals) if isinstance(evals, Mapping) else {"eval": evals})}
    named = {name: examples for name, examples in named.items() if examples}
    for name, examples in named.items():
        check_positions(model, examples, name, settings.backend)
        loader = settings.train if name == "train" else settings.eval
        if loader.packing:  # a row over an explicit pack_length, refused now rather than when its epoch is planned
            check_rows_fit(examples, [row_length(ex, loader.prefix_sharing) for ex in examples],
                           resolve_pack_length(examples, loader))
    if settings.backend not in ("sdpa", "segmented"):
        return
    itemsize, bound = _compute_itemsize(model, settings.half_precision), memory_bound(settings.device)
    for name, examples in named.items():
        if name == "train":
            passes = [Batches.of(settings.train, "training", "per_device_train_batch_size")]
        else:
            passes = [Batches.of(settings.eval, "evaluation", "per_device_eval_batch_size")]
        for batches in passes + list(settings.extra_passes):
            check_mask_memory(examples, batches, backend=settings.backend, itemsize=itemsize, bound=bound, name=name)
