"""What a group trainer reads of its config, read once: `GroupSettings` (as `training.settings` is for DPO).

A `PrefixGRPOTrainer` / `PrefixRLOOTrainer` takes either prefixdpo's config (`PrefixGRPOConfig`, with every option
below) or TRL's own `GRPOConfig` / `RLOOConfig`, which has none of prefixdpo's options: those then run at their
defaults. The settings are built from the config once, frozen, and nothing is written onto the user's config.

`LayoutKey` names what a pass's lines depend on besides its rows, so a pass over the same rows with the same key
reuses the lines (and the masks built for them) of the pass before it (`passes.GroupPasses.lines`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

from prefixdpo.grpo.config import GroupLayoutOptions
from prefixdpo.training.options import PrefixReuseOptions, RunSafetyOptions, SequenceParallelOptions, run_safety


@dataclass(frozen=True)
class GroupSettings:
    """A group trainer's own options (`grpo.config.GroupLayoutOptions`, prefix reuse, sequence parallelism, the run's
    safety) as one frozen value; `cast_lm_head_to_fp32` is GRPO's (RLOO has no such option: off)."""

    prefix_sharing: bool
    packing: bool
    pack_length: str | int  # "auto" or a length (the config makes an int of a number)
    attention: str
    shared_prompt_generation: bool
    shared_prompt_scoring: bool
    prefix_reuse: bool
    sequence_parallel_size: int
    cast_lm_head_to_fp32: bool
    safety: RunSafetyOptions

    @classmethod
    def from_config(cls, args) -> "GroupSettings":
        """The settings of `args`: a prefixdpo group config's values, or the defaults of the options a plain TRL
        config does not have."""
        def read(options_class, name):
            default = next(f.default for f in fields(options_class) if f.name == name)
            return getattr(args, name, default)

        layout = {f.name: read(GroupLayoutOptions, f.name) for f in fields(GroupLayoutOptions)}
        return cls(**layout, prefix_reuse=bool(read(PrefixReuseOptions, "prefix_reuse")),
                   sequence_parallel_size=int(read(SequenceParallelOptions, "sequence_parallel_size")),
                   cast_lm_head_to_fp32=bool(getattr(args, "cast_lm_head_to_fp32", False)), safety=run_safety(args))


class LayoutKey(NamedTuple):
    """What one pass's lines depend on besides TRL's rows (`layout.layout_groups`' arguments)."""

    logits_to_keep: int
    positions_from_mask: bool  # the model derives positions from the padding mask (`layout.MASK_POSITION_MODEL_TYPES`)
    packing: bool
    pack_length: str  # str(the setting): "auto" or a length
    bucketed: bool  # compiled kernels (flex, varlen): a few line lengths, multiples of 128
    tokens_per_pass: int | None  # prefix reuse: a group longer than this gets a line of its own
    shards: int  # sequence parallelism: every line padded to a multiple of the group's size
