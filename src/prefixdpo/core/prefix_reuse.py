"""Prefix reuse: a line longer than one pass may hold runs its shared prefix once and its suffixes in chunks.

A line (`data.lines`) is a token trie. When it holds more than `max_tokens_per_pass` tokens, the *prefix* (the
leading tokens every other token of the line descends from: a prompt, a system prompt and dialogue history) runs
once, keeping each layer's keys and values (`backends.PrefixKV`, carried by each pass's mask to prefixdpo's
attention); the subtrees after it (the responses, or subtrees of a trie) run in
*chunks* of whole subtrees, each chunk's queries attending the prefix's cached keys and values and their own by the
line's span rule. The hidden states are those of the one-row pass, token for token, so every loss and gradient is.

Under gradient each chunk but the last is an activation checkpoint (`torch.utils.checkpoint`, non-reentrant): its
forward keeps only its output (its hidden states; the prefix's K/V it reads are kept anyway), and backward, which
starts with the last chunk (kept whole), recomputes the others one at a time, so what is alive is the prefix's
activations plus one chunk's. The prefix's K/V gradients are summed over the chunks by autograd, and one backward
through the prefix finishes the pass. The price is one more forward of the suffix tokens but the last chunk's (not
of the prefix). Without gradient (a reference pass) nothing is
recomputed: the prefix runs once, each chunk once.

The plan (`core.attention.reuse_plan`: the prefix, the chunks) stands where the batch's attention mask stands, so
every pass over a micro-batch (policy, reference, pre-pass) runs it. Every model call happens inside the one forward of the module the engine wraps (`forward.through_engine`), so
DDP, FSDP2 and ZeRO-3 see one call per pass, as for a one-row pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from prefixdpo.core.attention.backends import PrefixKV, batch_attention_mask, with_prefix_kv
from prefixdpo.core.attention.reuse_plan import PrefixReuse


def _with_zero_path(hidden: torch.Tensor, out) -> torch.Tensor:
    """`hidden` plus exactly zero from the pass's own model output (its head at one position): FSDP2 crashes in
    backward when an output of a sharded module reaches no loss (as `forward.compute_response_logps` does)."""
    logits = getattr(out, "logits", None)
    return hidden + logits.sum() * 0.0 if logits is not None and logits.requires_grad else hidden


def _prefix_spans(spans: torch.Tensor, p: int) -> torch.Tensor:
    """[1, p, 2] spans of the prefix run alone (a chain: each token's subtree cut at the prefix's end)."""
    prefix = spans[:p].clone()
    prefix[:, 1] = p
    return prefix[None]


def _chunk_spans(spans: torch.Tensor, p: int, start: int, end: int) -> torch.Tensor:
    """[1, p + m, 2] spans of the prefix followed by the chunk's m tokens [start, end), moved next to it: the keys of a
    chunk's pass (the prefix every chunk token descends from, then the chunk)."""
    m = end - start
    prefix = _prefix_spans(spans, p)[0]
    prefix[:, 1] = p + m
    chunk = spans[start:end] - (start - p)
    return torch.cat([prefix, chunk])[None]


def reused_hidden_states(model, inner_forward, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         spans: torch.Tensor, reuse: PrefixReuse, decoder_output) -> torch.Tensor:
    """The decoder's final hidden states [B, L, D] of the lines, run as `reuse` plans them (module docstring), inside
    `through_engine`; zeros at padding. decoder_output: `forward.decoder_output` with the model's other inputs bound
    (passed in: `forward` imports this module)."""
    B, L = input_ids.shape
    lines: list[torch.Tensor | None] = [None] * B
    whole = [b for b, plan in enumerate(reuse.plans) if plan is None]
    options = dict(segment_waste=reuse.segment_waste)
    if whole:  # the lines that fit run together, as an ordinary pass
        index = torch.tensor(whole, device=input_ids.device)
        mask = batch_attention_mask(spans[index], reuse.backend, **options)
        hidden, out = decoder_output(model, inner_forward, input_ids=input_ids[index],
                                     position_ids=position_ids[index], attention_mask=mask)
        hidden = _with_zero_path(hidden, out)
        for i, b in enumerate(whole):
            lines[b] = hidden[i]
    for plan in (plan for plan in reuse.plans if plan is not None):
        b, p = plan.line, plan.prefix
        ids, pos, line_spans = input_ids[b:b + 1], position_ids[b:b + 1], spans[b]
        prefix_kv = PrefixKV()  # each layer's keys and values of the prefix, kept by its pass
        mask = with_prefix_kv(batch_attention_mask(_prefix_spans(line_spans, p), reuse.backend, **options), prefix_kv)
        hidden, out = decoder_output(model, inner_forward, input_ids=ids[:, :p], position_ids=pos[:, :p],
                                     attention_mask=mask)
        parts = [_with_zero_path(hidden, out)[0]]
        for k, (start, end) in enumerate(plan.chunks):
            chunk_mask = batch_attention_mask(_chunk_spans(line_spans, p, start, end), reuse.backend, queries_from=p,
                                              **options)
            chunk_mask = with_prefix_kv(chunk_mask, prefix_kv.prepended())

            def chunk(ids=ids, pos=pos, start=start, end=end, mask=chunk_mask):  # bound now: recomputed after the loop
                hidden, out = decoder_output(model, inner_forward, input_ids=ids[:, start:end],
                                             position_ids=pos[:, start:end], attention_mask=mask)
                return _with_zero_path(hidden, out)[0]

            # under gradient, a chunk's activations are recomputed in backward (module docstring), but the last one's:
            # backward starts with it, so keeping them costs no more than recomputing one chunk at a time
            last = k == len(plan.chunks) - 1
            parts.append(checkpoint(chunk, use_reentrant=False) if torch.is_grad_enabled() and not last else chunk())
        line = torch.cat(parts)
        lines[b] = torch.nn.functional.pad(line, (0, 0, 0, L - line.shape[0]))
    return torch.stack(lines)


__all__ = ["reused_hidden_states"]
