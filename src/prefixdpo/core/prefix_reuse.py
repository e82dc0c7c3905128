"""Prefix reuse: a line longer than one pass may hold runs its shared prefix once and its suffixes in chunks.

A line (`data.lines`) is a token trie. When it holds more than `max_tokens_per_pass` tokens, the *prefix* (the
leading tokens every other token of the line descends from: a prompt, a system prompt and dialogue history) runs
once, keeping each layer's keys and values (`prefix_kv.PrefixKV`, carried by each pass's plan to prefixdpo's
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

The plan (`core.attention.reuse_plan`: the prefix, the chunks) is the `reuse` of the batch's pass plan, so every pass
over a micro-batch (policy, reference, pre-pass) runs it; each of its passes runs a plan derived from it. Every model
call happens inside the one forward of the module the engine wraps (`model_call.through_engine`), so DDP sees one
call per pass, as for a one-row pass.

FSDP2 and ZeRO-3 also gather each layer's weights at each call of the layer, on every rank together (and again in
backward, for the layer's backward and a checkpointed chunk's recomputation), so every rank must make the same
sequence of layer calls, while each rank's own lines need their own passes. With several ranks every micro-batch
therefore gets a plan (`aligned`, also where all its lines fit), and before running it the ranks agree on its shape
(`agreed_shape`, two all-reduces of a few ints): whether a pass over the lines that fit runs, how many lines are
reused, and each one's number of chunk passes, the maximum over the ranks of each. A rank with less runs stand-in
passes in their places: a one-token whole pass, a reused line of a one-token prefix, one-token chunks reading the
(real or stand-in) prefix's K/V after a line's real chunks, checkpointed as real chunks are (all but the last
chunk pass of a line). Their outputs are added to the hidden states as `x.sum() * 0`: exactly zero, while their
backward runs, so autograd's backward order, and with it FSDP2's and ZeRO-3's gathers in backward, is the same on
every rank. A rank-balancing empty micro-batch (its stand-in line, `loader.stand_in_batch`) and the no-grad
reference pass take the same path. Under FSDP2 with `reshard_after_forward` (the default, FULL_SHARD) each pass
gathers each layer again: one all-gather per layer per pass in forward, one per layer per pass in backward (a
chunk's recomputation shares its backward's), measured on 2 gloo ranks; the gradients are still reduce-scattered
once per layer per micro-batch. With `reshard_after_forward=False` (SHARD_GRAD_OP) the forward passes share one
all-gather per layer, which stays gathered until its first backward; backward gathers it again for every pass
after the first.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from prefixdpo.core import model_call
from prefixdpo.core.attention.pass_plan import PassPlan, plan_pass
from prefixdpo.core.attention.prefix_kv import PrefixKV
from prefixdpo.core.attention.reuse_plan import PrefixReuse
from prefixdpo.core.rank_decisions import max_over_ranks


def _run(model, inner_forward, ids: torch.Tensor, pos: torch.Tensor, plan: PassPlan, model_inputs: dict):
    """The hidden states [b, l, D] of one pass (`model_call.model_pass`), plus the exact zero of its own output."""
    hidden, _, zero = model_call.model_pass(model, inner_forward, ids, pos, plan, **model_inputs)
    return hidden + zero


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


def _stand_in_chunk_spans(spans: torch.Tensor, p: int) -> torch.Tensor:
    """[1, p + 1, 2] spans of the prefix followed by one token that descends from it: a stand-in chunk's keys."""
    prefix = _prefix_spans(spans, p)[0]
    prefix[:, 1] = p + 1
    return torch.cat([prefix, torch.tensor([[p, p + 1]], dtype=spans.dtype, device=spans.device)])[None]


def agreed_shape(reuse: PrefixReuse, device) -> tuple[bool, list[int]]:
    """(whether a pass over the lines that fit runs, the chunk passes of each reused line, in order) for `reuse`: its
    own, or where it is `aligned` (several ranks) the maximum of each over the ranks, so that every rank makes the
    same model calls (module docstring). Two all-reduces: (whole pass, reused lines), then chunks per line."""
    whole = any(plan is None for plan in reuse.plans)
    chunks = [len(plan.chunks) for plan in reuse.plans if plan is not None]
    if not reuse.aligned:
        return whole, chunks
    runs_whole, lines = max_over_ranks([int(whole), len(chunks)], device)
    return bool(runs_whole), max_over_ranks(chunks + [0] * (lines - len(chunks)), device)


def _stand_in_whole(model, inner_forward, input_ids: torch.Tensor, reuse: PrefixReuse, model_inputs: dict):
    """A scalar 0 from a pass over one token of the batch: the whole pass of a rank whose lines all need chunks
    while another rank's fit (it runs every module, and its backward too)."""
    spans = torch.tensor([[[0, 1]]], device=input_ids.device)
    plan = plan_pass(spans, reuse.backend, segment_waste=reuse.segment_waste)
    one = input_ids[:1, :1]
    return _run(model, inner_forward, one, torch.zeros_like(one), plan, model_inputs).sum() * 0.0


def _line_passes(model, inner_forward, ids: torch.Tensor, pos: torch.Tensor, spans: torch.Tensor, p: int,
                 chunks: tuple[tuple[int, int], ...], count: int, reuse: PrefixReuse, model_inputs: dict):
    """The passes of one line ([1, n] ids and positions, [n, 2] spans): its prefix [0, p) once, then `count` chunk
    passes against the prefix's K/V, its `chunks` first and then one-token stand-ins (a rank whose line has fewer
    chunks than another rank's). -> (the prefix's and each real chunk's hidden states, [m, D] each; a scalar 0 with a
    path through every stand-in). Under gradient every chunk pass but the last is checkpointed, stand-ins alike, so
    the recomputations in backward line up across ranks too."""
    options = dict(segment_waste=reuse.segment_waste)
    prefix_kv = PrefixKV()  # each layer's keys and values of the prefix, kept by its pass
    plan = plan_pass(_prefix_spans(spans, p), reuse.backend, **options).with_prefix_kv(prefix_kv)
    parts, zero = [_run(model, inner_forward, ids[:, :p], pos[:, :p], plan, model_inputs)[0]], 0.0
    for k in range(count):
        real = k < len(chunks)
        if real:
            start, end = chunks[k]
            chunk_spans, chunk_ids, chunk_pos = _chunk_spans(spans, p, start, end), ids[:, start:end], pos[:, start:end]
        else:  # one token after the prefix, attending it: the stand-in reads the prefix's K/V as a chunk does
            chunk_spans, chunk_ids, chunk_pos = _stand_in_chunk_spans(spans, p), ids[:, p - 1:p], pos[:, p - 1:p] + 1
        chunk_plan = plan_pass(chunk_spans, reuse.backend, queries_from=p, **options)
        chunk_plan = chunk_plan.with_prefix_kv(prefix_kv.prepended())

        def chunk(ids=chunk_ids, pos=chunk_pos, plan=chunk_plan):  # bound now: recomputed after the loop
            return _run(model, inner_forward, ids, pos, plan, model_inputs)[0]

        # under gradient, a chunk's activations are recomputed in backward (module docstring), but the last one's:
        # backward starts with it, so keeping them costs no more than recomputing one chunk at a time
        last = k == count - 1
        hidden = checkpoint(chunk, use_reentrant=False) if torch.is_grad_enabled() and not last else chunk()
        if real:
            parts.append(hidden)
        else:
            zero = zero + hidden.sum() * 0.0
    return parts, zero


def reused_hidden_states(model, inner_forward, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: PassPlan,
                         model_inputs: dict) -> torch.Tensor:
    """The decoder's final hidden states [B, L, D] of the lines, run as `plan.reuse` says (module docstring), inside
    `through_engine`; zeros at padding. model_inputs: the model's other keywords, for each pass. Where the reuse is
    aligned, the passes are the ranks' agreed shape (`agreed_shape`): a rank with less to run adds stand-in passes,
    whose outputs are added as exact zeros."""
    reuse, spans = plan.reuse, plan.spans
    B, L = input_ids.shape
    lines: list[torch.Tensor | None] = [None] * B
    runs_whole, counts = agreed_shape(reuse, input_ids.device)
    whole = [b for b, line_plan in enumerate(reuse.plans) if line_plan is None]
    zero = 0.0
    if whole:  # the lines that fit run together, as an ordinary pass
        index = torch.tensor(whole, device=input_ids.device)
        whole_plan = plan_pass(spans[index], reuse.backend, segment_waste=reuse.segment_waste)
        hidden = _run(model, inner_forward, input_ids[index], position_ids[index], whole_plan, model_inputs)
        for i, b in enumerate(whole):
            lines[b] = hidden[i]
    elif runs_whole:
        zero = _stand_in_whole(model, inner_forward, input_ids, reuse, model_inputs)
    plans = [line_plan for line_plan in reuse.plans if line_plan is not None]
    for i, count in enumerate(counts):
        if i < len(plans):
            b, p = plans[i].line, plans[i].prefix
            parts, stand_ins = _line_passes(model, inner_forward, input_ids[b:b + 1], position_ids[b:b + 1], spans[b],
                                            p, plans[i].chunks, count, reuse, model_inputs)
            line = torch.cat(parts)
            lines[b] = torch.nn.functional.pad(line, (0, 0, 0, L - line.shape[0]))
        else:  # a stand-in line: a one-token prefix and `count` one-token chunks
            one = torch.tensor([[0, 1]], device=input_ids.device)
            parts, stand_ins = _line_passes(model, inner_forward, input_ids[:1, :1], torch.zeros_like(input_ids[:1, :1]),
                                            one, 1, (), count, reuse, model_inputs)
            stand_ins = stand_ins + torch.cat(parts).sum() * 0.0
        zero = zero + stand_ins
    hidden = torch.stack(lines)
    return hidden + zero if isinstance(zero, torch.Tensor) else hidden


__all__ = ["agreed_shape", "reused_hidden_states"]
