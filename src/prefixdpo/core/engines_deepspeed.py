"""DeepSpeed ZeRO for the trainer: the separate reference model made ready for the policy's ZeRO stage.

transformers.Trainer wraps the policy in a DeepSpeed engine itself (at `train()`); a separate reference
model is ours to prepare, as TRL's `prepare_deepspeed` does:

- ZeRO-3: the reference becomes a ZeRO-3 inference engine, partitioned over the ranks like the policy,
  so no rank holds a full copy and every module's weights are gathered inside its forward (prefixdpo runs
  the LM head inside the wrapped forward for this reason: `model_call.through_engine`).
- ZeRO-1/2: only optimizer state and gradients are partitioned, and the reference has neither: it is
  an engine with ZeRO off (stage 0), a whole copy per rank, as in TRL.

Training-only blocks (optimizer, scheduler, optimizer offload) are dropped from the reference's config,
and the ZeRO-3 sizes that transformers fills from the model's hidden size at `train()` (reduce and
prefetch buckets, the persistence threshold) are filled here the same way. TRL writes them under dotted
top-level keys that DeepSpeed never reads, so an `"auto"` there reaches DeepSpeed, which silently takes
its own defaults (persistence threshold 1e5: every smaller parameter of the reference stays whole on
every rank).

Under ZeRO-3 a policy loaded while the DeepSpeed config is active (`from_pretrained` under `zero.Init`)
holds only its partition on each rank: `copy.deepcopy` of it copies the empty partitions and their
DeepSpeed bookkeeping, and the copy fails in its first forward. `reference_copy` builds the frozen copy
of the starting policy (the reference when none is given and no adapter can be disabled) partitioned,
copying one gathered parameter at a time.

`deepspeed` is imported only inside the functions that need an initialised engine.
"""

from __future__ import annotations

import copy

import torch

from prefixdpo.errors import ConfigError

# the keys transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize` fills from the hidden size
_HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def zero_stage(accelerator) -> int | None:
    """The ZeRO stage of the run's DeepSpeed engine, or None when DeepSpeed is not in use."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def hidden_size_of(model_config) -> int | None:
    """The hidden size transformers sizes ZeRO buckets by (the largest of `hidden_sizes`; a text config's)."""
    for cfg in (model_config, getattr(model_config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


def reference_deepspeed_config(policy_config: dict, model_config) -> dict:
    """The DeepSpeed config of a no-grad reference engine, from the policy's (a new dict; TRL's rules).

    policy_config: the run's DeepSpeed config (accelerate's `deepspeed_plugin.deepspeed_config`, with the
    batch-size `"auto"`s already filled by Trainer). ZeRO-3 stays ZeRO-3; every other stage becomes 0
    (nothing to partition without gradients or optimizer state). `"auto"` bucket sizes and persistence
    threshold get the values transformers gives the policy at train() (from `model_config`'s hidden size);
    any other value, or none, stays as the user wrote it, as it does for the policy. Optimizer, scheduler and
    optimizer offload are dropped: the engine gets no optimizer; so is `train_batch_size` where the
    micro-batch size is given (DeepSpeed derives it).
    """
    cfg = copy.deepcopy(policy_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    if "train_micro_batch_size_per_gpu" in cfg:
        # The engine never steps, and DeepSpeed asserts train = micro x accumulation x world: a mismatch
        # there (an accelerate YAML's accumulation against --gradient_accumulation_steps) is the policy's
        # to report, with transformers' own message at train(), not this engine's to fail on at start.
        cfg.pop("train_batch_size", None)
    zero = dict(cfg.get("zero_optimization") or {})
    zero.pop("offload_optimizer", None)
    auto = [key for key in _HIDDEN_SIZE_KEYS if zero.get(key) == "auto"]
    if auto:  # what transformers fills for the policy at train(), the same values (absent keys stay absent)
        hidden = hidden_size_of(model_config)
        if hidden is None:
            raise ConfigError(
                f"deepspeed: zero_optimization.{auto[0]} is 'auto' but the reference model's config has no "
                "hidden_size to fill it from; set an integer value in the DeepSpeed config"
            )
        zero.update({key: _HIDDEN_SIZE_KEYS[key](hidden) for key in auto})
    if int(zero.get("stage", 0)) != 3:
        zero["stage"] = 0
    cfg["zero_optimization"] = zero
    return cfg


def prepare_deepspeed_reference(ref_model, accelerator):
    """`ref_model` (frozen, eval mode) as a DeepSpeed inference engine for the run's ZeRO stage (see the module
    docstring). Call it where the trainer prepares its reference, after `Trainer.__init__` (accelerate's
    DeepSpeed plugin holds the run's config by then). Returns the engine; `model_checks.unwrap` reaches the model."""
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        raise ConfigError("prepare_deepspeed_reference: this run does not use DeepSpeed")
    ref_model.requires_grad_(False)
    ref_model.eval()
    config = reference_deepspeed_config(plugin.deepspeed_config, ref_model.config)
    engine, *_ = deepspeed.initialize(model=ref_model, config=config)
    engine.eval()
    return engine


def is_zero3_partitioned(model) -> bool:
    """Whether any parameter of `model` is a ZeRO-3 partitioned one (it carries DeepSpeed's `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def zero3_partition_counts(model) -> tuple[int, int]:
    """(parameters whose local partition holds fewer elements than the whole, all parameters) of `model`.

    A ZeRO-3 parameter keeps its partition in `ds_tensor` ([ceil(ds_numel / world)] elements) and its full
    size in `ds_numel`; how a test or a log line shows that ZeRO-3 really partitioned the model.
    """
    params = list(model.parameters())
    partitioned = sum(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in params)
    return int(partitioned), len(params)


def reference_copy(policy):
    """A frozen copy of the starting `policy` (a bare Hugging Face model): `copy.deepcopy`, except for a
    ZeRO-3 partitioned policy, whose copy is built partitioned too (under `zero.Init`, as transformers
    builds a model while a ZeRO-3 config is active) and filled one gathered parameter at a time, so no
    rank ever holds more than one extra full parameter. Buffers and dropout rates are copied as they are."""
    if not is_zero3_partitioned(policy):
        return copy.deepcopy(policy)
    import deepspeed
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        raise ConfigError("the policy is ZeRO-3 partitioned but no ZeRO-3 DeepSpeed config is active: pass a "
                          "ref_model, or create the PrefixDPOConfig (with deepspeed=...) before loading the model")
    dtype = next(policy.parameters()).dtype
    ref = type(policy)._from_config(copy.deepcopy(policy.config), dtype=dtype)  # zero.Init: partitioned
    ours, theirs = list(ref.named_parameters()), list(policy.named_parameters())
    if [n for n, _ in ours] != [n for n, _ in theirs]:
        raise ConfigError(f"cannot copy {type(policy).__name__} for the reference: a fresh model of its config "
                          "has other parameters; pass a ref_model")
    with torch.no_grad():
        for (_, mine), (_, src) in zip(ours, theirs):
            # every rank gathers the same full tensor; rank 0's copy is re-partitioned on exit
            with deepspeed.zero.GatheredParameters([mine, src], modifier_rank=0):
                mine.data.copy_(src.data)
        for (_, mine), (_, src) in zip(ref.named_buffers(), policy.named_buffers(), strict=True):
            mine.copy_(src)
    for mine, src in zip(ref.modules(), policy.modules(), strict=True):
        if isinstance(src, torch.nn.Dropout):
            mine.p = src.p
    ref.train(policy.training)
    return ref


__all__ = ["hidden_size_of", "is_zero3_partitioned", "prepare_deepspeed_reference", "reference_copy",
           "reference_deepspeed_config", "zero3_partition_counts", "zero_stage"]
