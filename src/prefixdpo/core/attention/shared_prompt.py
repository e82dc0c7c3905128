"""Decoding over shared prompts: each unique prompt's keys and values held once, read by all its rows.

GRPO samples G completions of each prompt. After the shared prefill (`grpo/generation.py`) every decoding row's
cache starts with its prompt's keys and values; stored per row, as transformers' cache does, that is G copies of
each prompt, re-concatenated with the new token at every step and read G times. `SharedPromptLayer` keeps the U
unique prompts' keys and values once ([U, Hkv, P, D]) and only each row's own columns after them per row
([N, Hkv, s, D]). Attention over the two parts (cascade attention; Hydragen, arXiv 2402.05099) is exact: softmax
over [prompt | own] is the two parts' softmaxes merged by their log-sum-exps,

    out = out_prompt * exp(lse_prompt - lse) + out_own * exp(lse_own - lse),   lse = logaddexp(lse_prompt, lse_own),

and the prompt part runs as one matmul per unique prompt with its G rows' queries side by side ([U, Hkv, G x
groups, D] against [U, Hkv, P, D]) instead of N matrix-vector products.

Each decoding step runs with a plan naming the cache (`pass_plan.decoding_plan`, keyword `pass_plan`), so prefixdpo's
attention function (`backends.ATTENTION`) finds the layer of the attention module (its `layer_idx`) and, when the keys
it got are the ones that layer handed out, the prompt part; that part is masked by the prompts' own
padding (the prefill's mask, fixed for the whole generation), the rows' own part by transformers' mask. Anything
the merge does not cover (more than one query column, soft-capping, sinks, a non-bool mask, prompts of unequal row
counts) runs the ordinary attention over the prompt's keys gathered per row in front of the own ones: the same
numbers, without the saving.
A layer whose keys reached attention without being read stops the next step: a model that changed its keys after
the cache update would otherwise attend to its own columns only.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

_UNMERGED_FEATURES = ("softcap", "s_aux", "sinks", "sliding_window")


class SharedPromptLayer(DynamicLayer):
    """One layer's cache of N decoding rows over U unique prompts.

    prompt_keys / prompt_values: [U, Hkv, P, D] the prompts' columns; prompt_valid: [U, P] bool, the prompts' own
    padding mask (False: left padding); row_to_unique: [N] long, each row's prompt; `keys` / `values`
    (DynamicLayer's): [N, Hkv, s, D] each row's own columns after its prompt."""

    def __init__(self, prompt_keys: torch.Tensor, prompt_values: torch.Tensor, prompt_valid: torch.Tensor,
                 row_to_unique: torch.Tensor):
        super().__init__()
        self.prompt_keys, self.prompt_values = prompt_keys, prompt_values
        # [U, 1, 1, P]: broadcast over heads and each prompt's rows' queries (None: no padding)
        self.prompt_mask = None if bool(prompt_valid.bool().all()) else prompt_valid.bool()[:, None, None, :]
        self.row_to_unique = row_to_unique
        counts = torch.bincount(row_to_unique, minlength=prompt_keys.shape[0])
        # rows sorted by prompt ([U x G] when every prompt has G rows) and back: fixed for the whole generation
        self.group_size = int(counts[0]) if bool((counts == counts[0]).all()) and int(counts[0]) > 0 else None
        self.order = torch.argsort(row_to_unique, stable=True)
        self.unsorted = torch.argsort(self.order)
        self.unread = False

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.prompt_length + super().get_seq_length()

    def check_read(self) -> None:
        """Stops if the keys this layer handed out last reached attention without being read with the prompt."""
        if self.unread:
            raise RuntimeError("shared-prompt decoding: the model's attention did not read the shared prompt's keys "
                               "(its attention changed the cached keys on the way): set shared_prompt_generation "
                               "false for this model")

    def update(self, key_states, value_states, *args, **kwargs):
        """Append the new columns [N, Hkv, q, D]; return the rows' own columns (`keys` itself: the attention knows
        them by identity, `shared_prompt_attention`)."""
        self.check_read()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.unread = True
        return keys, values

    def whole_rows(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's [prompt | own] keys and values [N, Hkv, P + s, D] (the ordinary attention's inputs)."""
        self.unread = False
        return (torch.cat([self.prompt_keys[self.row_to_unique], key], dim=2),
                torch.cat([self.prompt_values[self.row_to_unique], value], dim=2))

    def attend(self, query, key, value, mask, kwargs) -> torch.Tensor | None:
        """Cascade attention of query [N, H, 1, D] over the prompt and key/value [N, Hkv, s, D]; mask: transformers'
        bool [N, 1, 1, P + s] (True: attend) or None, of which the rows' own columns are read (the prompt's are its
        padding, `prompt_mask`) -> [N, 1, H, D]; None where the merge does not apply."""
        if (query.shape[2] != 1 or self.group_size is None or any(kwargs.get(f) is not None for f in
                                                                   _UNMERGED_FEATURES)
                or (mask is not None and (mask.dtype != torch.bool or mask.shape[-2] != 1))):
            return None
        self.unread = False
        N, H, _, D = query.shape
        U, Hkv, P, _ = self.prompt_keys.shape
        G, groups, s = self.group_size, H // Hkv, key.shape[2]
        scaling = kwargs.get("scaling") or D ** -0.5
        own_mask = None
        if mask is not None:
            if mask.shape[-1] != P + s:
                raise RuntimeError(f"shared-prompt decoding: the mask spans {mask.shape[-1]} columns, the cache "
                                   f"{P} + {s}")
            own_mask = mask.expand(N, 1, 1, P + s)[..., P:]
        q = query.reshape(N, Hkv, groups, D)
        # the prompt part: each prompt's G rows' queries side by side against its keys
        q_sorted = q[self.order].reshape(U, G, Hkv, groups, D).transpose(1, 2).reshape(U, Hkv, G * groups, D)
        out_p, lse_p = _partial_attention(q_sorted, self.prompt_keys, self.prompt_values, self.prompt_mask, scaling)
        out_p = out_p.reshape(U, Hkv, G, groups, D).transpose(1, 2).reshape(N, Hkv, groups, D)[self.unsorted]
        lse_p = lse_p.reshape(U, Hkv, G, groups).transpose(1, 2).reshape(N, Hkv, groups)[self.unsorted]
        # the rows' own part
        out_o, lse_o = _partial_attention(q, key, value, own_mask, scaling)
        lse = torch.logaddexp(lse_p, lse_o)
        out = out_p * torch.exp(lse_p - lse)[..., None] + out_o * torch.exp(lse_o - lse)[..., None]
        return out.reshape(N, 1, H, D).to(query.dtype)


def _partial_attention(q, k, v, mask, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, Hkv, M, D] over k/v [B, Hkv, L, D] with a mask broadcast to [B, 1, M, L] (True:
    attend) or None -> (out [B, Hkv, M, D], lse [B, Hkv, M]), both in at least fp32; a query with no key allowed
    gives out 0 and lse -inf. The matmuls run in the cache's dtype, the softmax in fp32 (as transformers' eager
    attention), so a half-precision cache is read as it is, never copied up at each step."""
    scores = torch.matmul(q, k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(scores - finite[..., None])
    return torch.matmul(weights.to(v.dtype), v).to(scores.dtype), lse


def shared_prompt_attention(cache, module, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, mask,
                            kwargs):
    """(output or None, key, value) of an attention call of a decoding step over `cache` (a DynamicCache): where
    `key` is what the module's `SharedPromptLayer` (by `layer_idx`) handed out, the cascade's output [N, 1, H, D], or
    None with the whole rows' keys and values for the ordinary attention to run; else (None, key, value) unchanged
    (the layer, left unread, stops the next step: `check_read`)."""
    index = getattr(module, "layer_idx", None)
    layers = cache.layers
    layer = layers[index] if index is not None and 0 <= index < len(layers) else None
    if not isinstance(layer, SharedPromptLayer) or key is not layer.keys:
        return None, key, value
    out = layer.attend(query, key, value, mask, kwargs)
    if out is not None:
        return out, key, value
    key, value = layer.whole_rows(key, value)
    return None, key, value
