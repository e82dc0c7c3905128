"""One run component (`training.sharing_run.SharingRun`): what both trainer families need from prefix sharing (the
pass backend, the sequence-parallel group, prefix reuse's budget, the notes said once, the sharing metrics) is one
object each trainer holds (`trainer.sharing`) and hands explicitly to what reads it (the DPO step, the GRPO passes,
generation and scoring), not attributes a stack of mix-ins sets and reads on the trainer. Read from the source (a
grep, as `test_pass_plan.py`'s), and the trainers' classes as they are."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "prefixdpo"

# The prefixdpo classes each trainer mixes in (its MRO's, not counting itself): issue 36 part 3 took DPOTrainingStep
# (now the `DPOStep` the trainer holds) off the DPO trainer, and PrefixSharedLogps, SharedPromptGeneration,
# SharedPromptScoring and GuardedRewards (now `GroupPasses`, `SharedGeneration`, `SharedScoring`, `RewardGuard`) off
# the group trainers. Before: DPO 3, reward 2, GRPO 6, RLOO 6.
MIXINS = {
    "PrefixDPOTrainer": ["PrefixTrainerBase", "SurvivingRun"],
    "PrefixRewardTrainer": ["PrefixTrainerBase", "SurvivingRun"],
    "PrefixGRPOTrainer": ["PrefixGroupTrainer", "SurvivingRun"],
    "PrefixRLOOTrainer": ["PrefixGroupTrainer", "SurvivingRun"],
}

# The private (underscore) methods of transformers' Trainer / TRL's trainer each trainer still overrides, and why:
# a new one needs its reason here.
PREFERENCE_OVERRIDES = {
    "_prepare_inputs": "a micro-batch moves its own Batch to the device, in the pass (Trainer's moves dicts)",
    "_get_num_items_in_batch": "the loss is already scaled by the step's pairs (Trainer would count `labels`)",
    "_track_num_input_tokens": "input tokens counted from the micro-batch's lines (Trainer looks for `input_ids`)",
    "_get_grad_norm": "the non-finite guard reads the step's gradient norm before the optimizer step",
    "_save_checkpoint": "checkpoints staged in a hidden folder and sealed with the run's state, then renamed",
}
GROUP_OVERRIDES = {
    "_get_per_token_logps_and_entropies": "the one method through which TRL runs every log-prob pass",
    "_generate_single_turn": "routes its one `model.generate` call to the shared-prompt prefill",
    "_calculate_rewards": "reward models scored on shared lines; reward functions' output checked",
    "_get_train_sampler": "TRL's RepeatSampler made resumable by epoch (`EpochRepeatSampler`)",
    "_get_grad_norm": "the non-finite guard reads the step's gradient norm before the optimizer step",
    "_save_checkpoint": "checkpoints staged in a hidden folder and sealed with the run's state, then renamed",
}

# What the run component holds: no trainer, step or pass module keeps its own copy as `self.<name> = ...`.
SHARING_STATE = {"backend", "tokens_per_pass", "sequence_parallel", "sp_size", "said_once", "sharing_counts",
                 "_dp_rank", "_dp_world", "_layouts", "_last_layout", "_scoring_backend", "_generation_route"}
HOLDERS = ["training/base.py", "training/survival.py", "training/callbacks.py", "dpo/trainer.py", "dpo/step.py",
           "reward/trainer.py", "grpo/trainer.py", "grpo/passes.py", "grpo/rollout.py", "grpo/reward_checks.py"]
# The objects a trainer holds and calls: built with what they read, none of them a mix-in of a trainer.
COMPONENTS = {"dpo/step.py": ["DPOStep"], "grpo/passes.py": ["GroupPasses"],
              "grpo/rollout.py": ["SharedGeneration", "SharedScoring"], "grpo/reward_checks.py": ["RewardGuard"]}


def _trainers():
    pytest.importorskip("trl")
    from prefixdpo.dpo.trainer import PrefixDPOTrainer
    from prefixdpo.grpo.trainer import PrefixGRPOTrainer, PrefixRLOOTrainer
    from prefixdpo.reward.trainer import PrefixRewardTrainer

    return [PrefixDPOTrainer, PrefixRewardTrainer, PrefixGRPOTrainer, PrefixRLOOTrainer]


def _mixins(cls) -> list[str]:
    return [k.__name__ for k in cls.__mro__ if k is not cls and k.__module__.startswith("prefixdpo.")]


def _library_base(cls):
    """The transformers/TRL class a trainer is built on (the first of its MRO outside prefixdpo)."""
    return next(k for k in cls.__mro__ if not k.__module__.startswith("prefixdpo"))


def test_each_trainer_mixes_in_at_most_its_counted_classes():
    counts = {cls.__name__: _mixins(cls) for cls in _trainers()}
    assert counts == MIXINS


def test_the_private_library_methods_each_trainer_overrides_are_the_named_ones():
    for cls in _trainers():
        base = _library_base(cls)
        ours = [k for k in cls.__mro__ if k.__module__.startswith("prefixdpo.")]
        overridden = {name for k in ours for name in vars(k)
                      if name.startswith("_") and not name.startswith("__") and hasattr(base, name)}
        expected = GROUP_OVERRIDES if base.__module__.startswith("trl") else PREFERENCE_OVERRIDES
        assert overridden == set(expected), cls.__name__


def _self_writes(source: str, names: set[str]) -> list[str]:
    """`self.<name> = ...` (plain, augmented or annotated) of one of `names` in `source`, as 'line: code'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and t.attr in names):
                    found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def test_the_self_write_check_finds_a_copy_of_the_sharing_state():
    source = "def f(self):\n    self.backend = 'sdpa'\n    self._dp_rank, self.x = 0, 1\n    self.sharing.backend = 1\n"
    assert _self_writes(source, SHARING_STATE) == ["2: self.backend", "3: self._dp_rank"]


def test_the_run_component_is_the_one_holder_of_the_sharing_state():
    found = {path: writes for path in HOLDERS
             if (writes := _self_writes((SRC / path).read_text(encoding="utf-8"), SHARING_STATE))}
    assert not found, found


def test_both_trainer_families_build_their_run_component_with_start_sharing():
    for path in ("training/base.py", "grpo/trainer.py"):
        source = (SRC / path).read_text(encoding="utf-8")
        assert "self.sharing = start_sharing(" in source, path


def test_the_components_are_no_mixins():
    """The step, the passes, generation, scoring and the reward checks take what they read when built: none calls
    `super()` (a mix-in's way to reach the trainer's next class) or is a base of a trainer."""
    for path, names in COMPONENTS.items():
        tree = ast.parse((SRC / path).read_text(encoding="utf-8"))
        classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for name in names:
            calls = [node for node in ast.walk(classes[name]) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Name) and node.func.id == "super"]
            assert not calls, f"{path}: {name} calls super()"
    bases = {name for cls in _trainers() for name in _mixins(cls)}
    assert not bases & {name for names in COMPONENTS.values() for name in names}


def test_the_dpo_step_takes_its_dependencies_explicitly():
    import inspect

    from prefixdpo.dpo.step import DPOStep

    params = list(inspect.signature(DPOStep.__init__).parameters)
    assert params[1:5] == ["objective", "coupling", "reference", "sharing"]
    assert {"device", "pad_token_id", "pad_multiple", "chunk_size"} <= set(params)


def test_the_run_component_counts_notes_and_drains():
    from prefixdpo.training.sharing_run import SaidOnce, SharingRun

    notes = []
    run = SharingRun("sdpa", said_once=SaidOnce(SimpleNamespace(warning=lambda *a: notes.append(a[1:3]))))
    assert (run.sp_size, run.counted, run.drain("train", None)) == (1, True, {})
    run.note("prefix sharing", "why", "what then")
    run.note("prefix sharing", "why", "what then")
    assert notes == [("prefix sharing", "why")]
    assert run.backend_for("cpu", needs_grad=True) == "sdpa"
    assert SharingRun("stock").backend_for("cpu", needs_grad=True) == "stock"  # the model's own attention, as it is
    drained = []
    counts = SimpleNamespace(drain=lambda mode, accelerator, **which: drained.append((mode, which)) or {"m": 1.0})
    assert SharingRun("sdpa", counts=counts).drain("eval", None, passes=True) == {"m": 1.0}
    assert drained == [("eval", {"passes": True})]
    group = SimpleNamespace(size=2, rank=1)
    assert (SharingRun("sdpa", sequence_parallel=group).sp_size,
            SharingRun("sdpa", sequence_parallel=group).counted) == (2, False)


def test_said_once_is_the_run_components_and_the_group_notes_reexport_it():
    from prefixdpo.grpo.run_notes import SaidOnce as grpo_said_once
    from prefixdpo.training.sharing_run import SaidOnce

    assert grpo_said_once is SaidOnce
    assert isinstance(SaidOnce(logging.getLogger("x")).said, set)


def test_a_dpo_trainer_and_its_step_hold_one_run_component(tmp_path):
    """(~2 s) The DPO trainer's step reads the trainer's own `SharingRun`; the loaders read its backend."""
    from conftest import make_examples, tiny_model
    from test_trainer import config

    from prefixdpo import PrefixDPOTrainer
    from prefixdpo.training.sharing_run import SharingRun

    trainer = PrefixDPOTrainer(model=tiny_model("llama"), args=config(tmp_path), train_dataset=make_examples(4))
    assert isinstance(trainer.sharing, SharingRun) and trainer.step.sharing is trainer.sharing
    assert trainer.sharing.backend == "sdpa" and trainer.sharing.sequence_parallel is None
    assert trainer._loader_settings(train=True).bucket is False  # sdpa: no bucketing (flex would bucket)
    assert trainer.coupling is trainer.step.coupling


def test_a_group_trainer_and_its_components_hold_one_run_component(tmp_path):
    """(~2 s) The GRPO trainer's passes, generation and scoring read the trainer's own `SharingRun`; changing the
    attention setting changes the backend they run."""
    from grpo_common import prompt_dataset, reward_vowels, tiny_causal_lm, tokenizer

    from prefixdpo.grpo import PrefixGRPOConfig, PrefixGRPOTrainer
    from prefixdpo.grpo.run_notes import SharingCounts

    args = PrefixGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=8, use_cpu=True, bf16=False, report_to="none")
    trainer = PrefixGRPOTrainer(model=tiny_causal_lm(), reward_funcs=reward_vowels, args=args,
                                train_dataset=prompt_dataset(4), processing_class=tokenizer())
    sharing = trainer.sharing
    assert trainer.passes.sharing is sharing and trainer.generation.sharing is sharing
    assert trainer.scoring.sharing is sharing and isinstance(sharing.counts, SharingCounts)
    assert sharing.tokens_per_pass is None  # no prefix reuse asked
    # the option as the model runs it, resolved for each pass's device and grad mode: auto is sdpa on CPU
    assert sharing.backend == "auto" and sharing.backend_for("cpu", needs_grad=True) == "sdpa"
    trainer.change_settings(attention="segmented")
    assert sharing.backend == "segmented" == trainer.group_settings.attention
