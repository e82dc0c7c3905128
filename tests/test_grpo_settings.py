"""The group trainers read their options once (`grpo.settings.GroupSettings`) and write nothing onto the user's
config: TRL's own `GRPOConfig` / `RLOOConfig` run at prefixdpo's defaults, prefixdpo's configs at their values."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from grpo_common import prompt_dataset, reward_vowels, tiny_causal_lm, tokenizer
from trl import GRPOConfig, RLOOConfig

from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer, PrefixRLOOConfig, PrefixRLOOTrainer
from prefixdpo.grpo.config import GroupLayoutOptions
from prefixdpo.grpo.settings import GroupSettings, LayoutKey
from prefixdpo.training.options import PrefixSharingOptions, RunSafetyOptions, SharedLineOptions

COMMON = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, use_cpu=True, bf16=False,
              report_to="none")
OURS = ("nonfinite", "nonfinite_max_consecutive", "overwrite_output_dir", "prefix_sharing", "packing",
        "pack_length", "attention", "prefix_reuse", "sequence_parallel_size")


def _trainer(trainer_class, args):
    torch.set_num_threads(1)  # tiny models; conftest's fixture restores the thread count
    return trainer_class(model=tiny_causal_lm(), reward_funcs=reward_vowels, args=args,
                         train_dataset=prompt_dataset(4), processing_class=tokenizer())


@pytest.mark.parametrize("config_class, trainer_class", [(GRPOConfig, PrefixGRPOTrainer),
                                                         (RLOOConfig, PrefixRLOOTrainer)])
def test_a_plain_trl_config_runs_at_the_defaults_and_is_not_written(tmp_path, config_class, trainer_class):
    args = config_class(output_dir=str(tmp_path), beta=0.0, **COMMON)  # beta > 0 loads a reference by name
    trainer = _trainer(trainer_class, args)
    settings = trainer.group_settings
    assert settings.prefix_sharing and settings.packing and settings.pack_length == "auto"
    assert settings.attention == "auto" and not settings.prefix_reuse and settings.sequence_parallel_size == 1
    assert settings.safety == RunSafetyOptions()
    assert trainer.nonfinite.policy == "stop"  # the run's guard took the default
    assert not [name for name in OURS if name in vars(args)], "prefixdpo's options were written onto TRL's config"


def test_prefixdpo_config_values_reach_the_settings_and_changes_leave_the_config(tmp_path):
    args = PrefixGRPOConfig(output_dir=str(tmp_path), packing=False, pack_length="256", attention="segmented",
                            nonfinite="skip", nonfinite_max_consecutive=3, cast_lm_head_to_fp32=True, **COMMON)
    trainer = _trainer(PrefixGRPOTrainer, args)
    settings = trainer.group_settings
    assert (settings.packing, settings.pack_length, settings.attention) == (False, 256, "segmented")
    assert settings.safety == RunSafetyOptions(nonfinite="skip", nonfinite_max_consecutive=3)
    assert settings.cast_lm_head_to_fp32 and trainer.nonfinite.policy == "skip"
    with pytest.raises(AttributeError):
        settings.packing = True  # frozen: read once, changed only by `change_settings`
    trainer.change_settings(packing=True, attention="sdpa")
    assert (trainer.group_settings.packing, trainer.group_settings.attention) == (True, "sdpa")
    assert (args.packing, args.attention) == (False, "segmented")


def test_rloo_has_no_fp32_head_option():
    assert GroupSettings.from_config(PrefixRLOOConfig(output_dir="unused", **COMMON)).cast_lm_head_to_fp32 is False


def test_group_options_inherit_the_shared_line_fields_and_repeat_none():
    shared = {f.name for f in fields(SharedLineOptions)}
    assert shared == {"prefix_sharing", "packing", "pack_length", "attention"}
    assert shared <= {f.name for f in fields(GroupLayoutOptions)} and shared <= {f.name for f in fields(PrefixSharingOptions)}
    # declared again in the group options: only packing, whose default differs (on: TRL's batch counts completions)
    assert set(GroupLayoutOptions.__annotations__) & shared == {"packing"}
    assert not set(PrefixSharingOptions.__annotations__) & shared
    assert GroupLayoutOptions().packing is True and PrefixSharingOptions().packing is False
    assert {f.name for f in fields(GroupSettings)} >= {f.name for f in fields(GroupLayoutOptions)}


def test_the_layout_cache_is_keyed_by_named_fields(tmp_path):
    trainer = _trainer(PrefixGRPOTrainer, PrefixGRPOConfig(output_dir=str(tmp_path), **COMMON))
    ids = torch.randint(3, 60, (4, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 4)
    key = trainer.passes.last_layout.key
    assert isinstance(key, LayoutKey)
    assert key._asdict() == dict(logits_to_keep=4, positions_from_mask=False, packing=True, pack_length="auto",
                                 bucketed=False, tokens_per_pass=None, shards=1)


class _CountingAccelerator:
    """accelerate's `reduce` on one process, counting its calls (each is a collective every rank must make)."""

    device = torch.device("cpu")

    def __init__(self):
        self.reductions = 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reductions += 1
        return tensor


def test_what_sharing_saved_is_drained_in_one_reduction_and_reset():
    from types import SimpleNamespace

    from prefixdpo.grpo.run_notes import SharingCounts

    counts, accelerator = SharingCounts(), _CountingAccelerator()
    counts.count_lines("train", SimpleNamespace(num_real_tokens=30, trl_tokens=120, num_slots=40))
    counts.prefill["train"].trl_tokens, counts.prefill["train"].ran_tokens = 200, 50
    counts.count_lines("eval", SimpleNamespace(num_real_tokens=1, trl_tokens=2, num_slots=4))
    assert counts.drain("train", accelerator, passes=True, prefill=True) == {
        "prefix_sharing/tokens_saved": 0.75, "packing/efficiency": 0.75, "prefix_sharing/prefill_tokens_saved": 0.75}
    assert accelerator.reductions == 1
    assert counts.drain("train", accelerator, passes=True, prefill=True) == {}  # reset: nothing since the last log
    assert counts.drain("eval", accelerator, passes=True, prefill=False) == {
        "prefix_sharing/tokens_saved": 0.5, "packing/efficiency": 0.25}
    assert counts.drain("eval", accelerator, passes=False, prefill=False) == {} and accelerator.reductions == 3


def test_each_reason_is_said_once_per_kind(caplog):
    import logging

    from prefixdpo.grpo.run_notes import SaidOnce

    said = SaidOnce(logging.getLogger("test_said_once"))
    with caplog.at_level(logging.WARNING, logger="test_said_once"):
        for _ in range(3):
            said("prefix sharing", "images", "such passes run TRL's own layout")
            said("shared-prompt scoring", "images", "such calls score TRL's padded rows")
    assert [r.getMessage() for r in caplog.records] == [
        "prefix sharing: images; such passes run TRL's own layout (said once)",
        "shared-prompt scoring: images; such calls score TRL's padded rows (said once)"]
