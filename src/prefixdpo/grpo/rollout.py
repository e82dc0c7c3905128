"""The rollout half of a TRL group step, prefix-shared: generation (`generation.py`) and reward-model scoring
(`reward_models.py`), as mix-ins over TRL 1.16's `GRPOTrainer` / `RLOOTrainer` (before the TRL class; they read the
options through `PrefixSharedLogps.group_settings`).

Each replaces one call inside TRL's own method for the duration of that method, so TRL's code around it (tokenizing,
padding, unwrap and gather contexts, EOS masks, reward weighting, NaN handling, gathering across ranks) runs
unchanged: `model.generate(...)` in `_generate_single_turn`, `reward_model(**inputs).logits` in `_calculate_rewards`.
Where sharing cannot reproduce a call, TRL's call runs, and each reason is logged once.
"""

from __future__ import annotations

import json
import logging

import torch

from prefixdpo.core.attention.backends import resolve_backend
from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import prepare_model
from prefixdpo.grpo.generation import SharedPromptRoute, generate_routed
from prefixdpo.grpo.reward_models import SharedPrefixScorer
from prefixdpo.core.scores import score_head

logger = logging.getLogger(__name__)


class SharedPromptGeneration:
    """TRL's transformers generation with each unique prompt prefilled once (`generation.py`), mixed in before the TRL
    class. TRL's `_generate_single_turn` runs unchanged (tokenizing, left padding, its unwrap and gather contexts, the
    EOS mask after generation); only its one `unwrapped_model.generate(**inputs, generation_config=...)` call is
    routed, for the duration of that method, to `generation.SharedPromptRoute`, which computes the same sequences or
    makes TRL's call, saying once why. vLLM and transformers' continuous batching are TRL's paths untouched."""

    def _setup_shared_generation(self) -> None:
        self._generation_route = SharedPromptRoute(self._note_generation_fallback)
        if self.group_settings.shared_prompt_generation and getattr(self, "use_vllm", False):
            _say_vllm_prefix_caching(self)

    def _generate_single_turn(self, *args, **kwargs):
        if (not self.group_settings.shared_prompt_generation or getattr(self, "use_vllm", False)
                or getattr(self, "use_transformers_continuous_batching", False)):
            return super()._generate_single_turn(*args, **kwargs)
        # the object TRL's `unwrap_model_for_generation` yields and calls `generate` on
        model = self.accelerator.unwrap_model(self.model_wrapped)
        if "generate" in vars(model):  # a custom_generate the model brought: not transformers' own loop
            self._note_generation_fallback("the model has its own generate (a custom_generate)")
            return super()._generate_single_turn(*args, **kwargs)
        self._generation_route.count = self.sharing_counts.prefill["train" if self.model.training else "eval"]
        with generate_routed(model, self._generation_route):
            return super()._generate_single_turn(*args, **kwargs)

    def _note_generation_fallback(self, reason: str) -> None:
        self.said_once("shared-prompt generation", reason, "such generate calls run as TRL makes them")


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


class SharedPromptScoring:
    """TRL's reward-model scoring with each prompt's completions on one shared line (`reward_models.py`)."""

    def _setup_shared_scoring(self) -> None:
        """After TRL's `__init__`: the reward models that can be scored shared run prefixdpo's attention."""
        self._shared_reward_models: list[int] = []
        if not self.group_settings.shared_prompt_scoring:
            return
        self._scoring_backend = resolve_backend(self.group_settings.attention, self.accelerator.device,
                                                needs_grad=False)
        for i, func in enumerate(self.reward_funcs):
            if not isinstance(func, torch.nn.Module):
                continue
            try:
                score_head(func)
                prepare_model(func, self._scoring_backend)
            except UnsupportedModelError as err:
                self._note_scoring_fallback(f"reward model {self.reward_func_names[i]}: {err}")
                continue
            self._shared_reward_models.append(i)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if not self._shared_reward_models:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        groups = prompt_groups(prompts)
        saved = self.reward_funcs
        self.reward_funcs = [
            SharedPrefixScorer(func, groups, backend=self._scoring_backend, packing=self.group_settings.packing,
                               pack_length=self.group_settings.pack_length, fallback=self._note_scoring_fallback)
            if i in self._shared_reward_models else func for i, func in enumerate(saved)]
        try:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = saved

    def _note_scoring_fallback(self, reason: str) -> None:
        self.said_once("shared-prompt scoring", reason, "such calls score TRL's padded rows")


def prompt_groups(prompts: list) -> list[int]:
    """[N] the group of each row: rows with equal prompts (text, or messages compared as JSON) share one."""
    seen: dict[str, int] = {}
    keys = [p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str) for p in prompts]
    return [seen.setdefault(k, len(seen)) for k in keys]
