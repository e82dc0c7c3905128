"""Every private name of transformers, TRL and accelerate that prefixdpo overrides, calls, reads or writes: the
contract an upgrade can break.

A new TRL or transformers may rename or reshape any of these without notice, and then a run would fail deep
inside a step (or, worse, an override would silently stop being called). `pyproject.toml` bounds those libraries
above for that reason, `training/versions.py` warns at start outside the bounds, and tests/test_internals.py checks
this table against what is installed: each name exists on its owner, each method still takes the parameters
listed (in that order), each attribute is still set by its owner, and every private override or `super()` call in
prefixdpo's classes is listed here (a new one cannot be added without its line).

use: "override" (prefixdpo defines the method; the library calls it), "call" (prefixdpo calls the library's),
"read" / "write" (an attribute the library sets up, which prefixdpo reads or assigns), "swap" (prefixdpo replaces
it on a live object for the duration of a call, and restores it). parameters: the method's leading parameter names
prefixdpo relies on (None for an attribute).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrivateName", "PRIVATE_NAMES", "OWNERS"]

TRAINER = "transformers.trainer.Trainer"
GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
RLOO = "trl.trainer.rloo_trainer.RLOOTrainer"
GROUP_TRAINERS = (GRPO, RLOO)


@dataclass(frozen=True)
class PrivateName:
    owner: str  # the defining class or module, dotted ("transformers.trainer.Trainer")
    name: str  # the private attribute ("_save_checkpoint")
    use: str  # override | call | read | write | swap
    parameters: tuple[str, ...] | None  # a method's leading parameter names relied on; None: not a method
    where: str  # prefixdpo's module that uses it
    why: str

    @property
    def dotted(self) -> str:
        return f"{self.owner}.{self.name}"


def _both_group_trainers(name, use, parameters, where, why) -> list[PrivateName]:
    return [PrivateName(owner, name, use, parameters, where, why) for owner in GROUP_TRAINERS]


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # transformers.Trainer, overridden by every prefixdpo trainer (training/base.py, training/survival.py)
    PrivateName(TRAINER, "_prepare_inputs", "override", ("self", "inputs"), "training/base.py",
                "prefix-shared batches are not tensors of input_ids: moved to the device as a whole"),
    PrivateName(TRAINER, "_get_num_items_in_batch", "override", ("self", "batch_samples", "device"),
                "training/base.py", "the loss is normalised per pair, not per token of a packed line"),
    PrivateName(TRAINER, "_track_num_input_tokens", "override", ("self", "inputs"), "training/base.py",
                "num_input_tokens_seen counts the tokens a packed line really holds"),
    PrivateName(TRAINER, "_get_grad_norm", "override", ("self", "model", "grad_norm"), "training/survival.py",
                "a non-finite gradient norm skips the step (--nan_policy) before the optimizer sees it"),
    PrivateName(TRAINER, "_save_checkpoint", "override", ("self", "model", "trial"), "training/survival.py",
                "checkpoints are written into a hidden staging folder and sealed (atomic, digests)"),
    PrivateName(TRAINER, "_get_output_dir", "swap", ("self", "trial"), "training/survival.py",
                "pointed at the staging folder while transformers writes a checkpoint"),
    PrivateName(TRAINER, "_wrap_model", "call", ("self", "model", "training", "dataloader"), "training/base.py",
                "the evaluation loop wraps the model as Trainer's own does"),
    PrivateName(TRAINER, "loss_is_scaled_for_ga", "write", None, "training/base.py",
                "public, but new in transformers 5.2x (5.17 lacks it: gradient accumulation would halve the loss): "
                "Trainer must not divide a loss already scaled per pair"),
    PrivateName(TRAINER, "_train_batch_size", "read", None, "training/base.py",
                "the per-device batch size after auto_find_batch_size"),
    # TRL's group trainers (grpo/)
    *_both_group_trainers("_get_per_token_logps_and_entropies", "override",
                          ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                           "compute_entropy"), "grpo/trainer.py (calling grpo/passes.py)",
                          "the log-prob passes run on prefix-shared lines (falls back to TRL's where it cannot)"),
    *_both_group_trainers("_get_train_sampler", "override", ("self", "dataset"), "grpo/trainer.py",
                          "a sampler whose order survives a resume"),
    *_both_group_trainers("_generate_single_turn", "override", ("self", "prompt_ids", "images", "multimodal_fields"),
                          "grpo/trainer.py (calling grpo/rollout.py)",
                          "each prompt is prefilled once for its G completions"),
    *_both_group_trainers("_calculate_rewards", "override",
                          ("self", "inputs", "prompts", "completions", "completion_ids_list"),
                          "grpo/trainer.py (calling grpo/rollout.py, grpo/reward_checks.py)",
                          "reward models score shared prompts once; a reward function's fault ends the run in one "
                          "line"),
    *_both_group_trainers("_save_checkpoint", "override", ("self", "model", "trial"), "training/survival.py",
                          "TRL's own (a model card) runs inside prefixdpo's staged, sealed save"),
    *_both_group_trainers("_metrics", "read", None, "grpo/trainer.py",
                          "the sharing metrics are logged beside TRL's own"),
    *_both_group_trainers("_step", "write", None, "grpo/trainer.py",
                          "a resume restores TRL's micro-step count (which generation a step reuses)"),
    # transformers' models and generation
    PrivateName("transformers.generation.utils.GenerationMixin", "_supports_default_dynamic_cache", "call",
                (), "grpo/generation.py", "shared-prompt decoding needs the default dynamic cache"),
    PrivateName("transformers.generation.utils.GenerationMixin", "_prepare_generation_config", "call",
                ("self", "generation_config"), "grpo/generation.py",
                "the config generate will decode with (the model's defaults merged in)"),
    PrivateName("transformers.modeling_utils.PreTrainedModel", "_from_config", "call", ("config",),
                "core/engines_deepspeed.py", "a ZeRO-3 reference model built partitioned (zero.Init)"),
    PrivateName("transformers.modeling_utils.PreTrainedModel", "_keys_to_ignore_on_load_missing", "write", None,
                "reward/model.py", "a causal LM's checkpoint loads as a reward model without its score head"),
    PrivateName("transformers.modeling_utils.PreTrainedModel", "_keys_to_ignore_on_load_unexpected", "write", None,
                "reward/model.py", "a causal LM's lm_head is not reported as unexpected in a reward model"),
    PrivateName("transformers.configuration_utils.PreTrainedConfig", "_attn_implementation", "read", None,
                "core/verify.py, tools/gpu_check/sequence_parallel.py",
                "verify compares with the model's stock attention and restores the user's"),
    # accelerate
    PrivateName("accelerate.state.PartialState", "_shared_state", "write", None, "core/engines.py",
                "FSDP2 on CPU: accelerate sets the distributed type only on a GPU"),
    PrivateName("accelerate.optimizer.AcceleratedOptimizer", "_is_overflow", "write", None, "training/nonfinite.py",
                "a skipped step (non-finite gradients) does not step the lr scheduler"),
    # TRL's kernels (the benchmark only)
    PrivateName("trl.kernels.chunked_logprob", "_use_triton", "call", None, "tools/bench/grpo.py",
                "the GRPO benchmark times TRL's log-prob kernel as TRL picks it"),
)

OWNERS = sorted({entry.owner for entry in PRIVATE_NAMES})
