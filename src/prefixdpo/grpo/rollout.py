"""The rollout half of a TRL group step, prefix-shared: generation (`generation.py`) and reward-model scoring
(`reward_models.py`), as two objects a group trainer builds once and calls from its overrides of TRL 1.16's
`_generate_single_turn` and `_calculate_rewards` (`trainer.PrefixGroupTrainer`); each reads the run's prefix sharing
(`training.sharing_run.SharingRun`: the backend, the notes said once, the prefill counts) and takes the trainer's
options (`settings.GroupSettings`) with each call.

Each replaces one call inside TRL's own method for the duration of that method, so TRL's code around it (tokenizing,
padding, unwrap and gather contexts, EOS masks, reward weighting, NaN handling, gathering across ranks) runs
unchanged: `model.generate(...)` in `_generate_single_turn`, `reward_model(**inputs).logits` in `_calculate_rewards`.
Where sharing cannot reproduce a call, TRL's call runs, and each reason is said once.
"""

from __future__ import annotations

import contextlib
import json
import logging

import torch

from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.grpo.generation import SharedPromptRoute, generate_routed
from prefixdpo.grpo.reward_models import SharedPrefixScorer
from prefixdpo.core.scores import score_head

logger = logging.getLogger(__name__)


class SharedGeneration:
    """TRL's transformers generation with each unique prompt prefilled once (`generation.py`). TRL's
    `_generate_single_turn` runs unchanged (tokenizing, left padding, its unwrap and gather contexts, the EOS mask after
    generation); only its one `unwrapped_model.generate(**inputs, generation_config=...)` call is routed, for the
    duration of that method, to `generation.SharedPromptRoute`, which computes the same sequences or makes TRL's call,
    saying once why. vLLM and transformers' continuous batching are TRL's paths untouched (the trainer's choice)."""

    def __init__(self, sharing):
        self.sharing = sharing
        self.route = SharedPromptRoute(self.note_fallback)

    def generate(self, model, mode: str, trl_generate):
        """TRL's `_generate_single_turn` (`trl_generate`, its arguments bound) with `model.generate` routed; `model`:
        the object TRL's `unwrap_model_for_generation` yields and calls `generate` on; mode: train / eval, whose
        prefill counts the route adds to."""
        if "generate" in vars(model):  # a custom_generate the model brought: not transformers' own loop
            self.note_fallback("the model has its own generate (a custom_generate)")
            return trl_generate()
        self.route.count = self.sharing.counts.prefill[mode]
        with generate_routed(model, self.route):
            return trl_generate()

    def note_fallback(self, reason: str) -> None:
        self.sharing.note("shared-prompt generation", reason, "such generate calls run as TRL makes them")


def _say_vllm_prefix_caching(trainer) -> None:
    """With use_vllm, TRL's generation is vLLM's: say what shares the prompts there, and warn if nothing does."""
    if trainer.args.vllm_mode == "server":
        logger.info("use_vllm (server): TRL sends each prompt once with n=num_generations; shared_prompt_generation "
                    "has nothing to do")
        return
    engine = getattr(getattr(getattr(trainer, "vllm_generation", None), "llm", None), "llm_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    enabled = getattr(config, "enable_prefix_caching", None)
    if enabled is False:
        logger.warning("use_vllm (colocate): vLLM's prefix caching is off, so each of a prompt's num_generations "
                       "copies is prefilled; vLLM's default (on) computes a prompt's KV blocks once")
    elif enabled is None:
        logger.info("use_vllm (colocate): could not read whether vLLM's prefix caching is on (its default is on)")


class SharedScoring:
    """TRL's reward-model scoring with each prompt's completions on one shared line (`reward_models.py`). Built after
    TRL's `__init__`: the reward models (of `reward_funcs`, named `names`) that can be scored shared are switched to
    prefixdpo's attention, when `enabled` (`shared_prompt_scoring`)."""

    def __init__(self, sharing, reward_funcs: list, names: list, *, enabled: bool, device):
        self.sharing = sharing
        self.models: list[int] = []  # the indices of the reward models scored shared
        self.models_backend = None  # the backend those reward models were switched to, once
        if not enabled:
            return
        self.models_backend = sharing.backend_for(device, needs_grad=False)
        for i, func in enumerate(reward_funcs):
            if not isinstance(func, torch.nn.Module):
                continue
            try:
                score_head(func)
                prepare_model(func, self.models_backend)
            except UnsupportedModelError as err:
                self.note_fallback(f"reward model {names[i]}: {err}")
                continue
            self.models.append(i)

    @contextlib.contextmanager
    def routed(self, trainer, prompts: list, settings):
        """For the duration of TRL's `_calculate_rewards` on `prompts`: `trainer.reward_funcs` with each reward model
        scored shared in its place (`SharedPrefixScorer`, laid out as `settings` say), put back after."""
        if not self.models:
            yield
            return
        groups = prompt_groups(prompts)
        saved = trainer.reward_funcs
        trainer.reward_funcs = [
            SharedPrefixScorer(func, groups, backend=self.models_backend, packing=settings.packing,
                               pack_length=settings.pack_length, fallback=self.note_fallback)
            if i in self.models else func for i, func in enumerate(saved)]
        try:
            yield
        finally:
            trainer.reward_funcs = saved

    def note_fallback(self, reason: str) -> None:
        self.sharing.note("shared-prompt scoring", reason, "such calls score TRL's padded rows")


def prompt_groups(prompts: list) -> list[int]:
    """[N] the group of each row: rows with equal prompts (text, or messages compared as JSON) share one."""
    seen: dict[str, int] = {}
    keys = [p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str) for p in prompts]
    return [seen.setdefault(k, len(seen)) for k in keys]
