"""A useful-FLOP model: what standard DPO and prefix sharing must compute, and the ideal speedup.

Counted per forward pass of one sequence/row (multiply-add = 2 FLOPs):

    body      2 * body_params_per_token * tokens          (q, k, v, o projections with GQA + SwiGLU MLP)
              + recurrent_flops_per_token * tokens        (hybrids: the state updates of their recurrent layers)
    attention 4 * heads * head_dim * allowed_pairs        per attention layer (q.k^T and p.v, 2 FLOPs each)
    LM head   2 * hidden * vocab * head_positions         (only positions that predict a response token)

A hybrid model (Qwen3.5's Gated DeltaNet, LFM's short convolutions, Mamba2, Kimi Delta Attention) pays the pair
term on its attention layers only; a recurrent layer's cost is linear in tokens, so on its layers prefix sharing
saves the prompt's repeated tokens and nothing more (a recurrent layer's projections are counted as attention's).

"Useful" means padding, masked-out attention blocks, embeddings lookups, norms, softmax and biases are
not counted, and the LM head is counted only where a response token is predicted, on both sides.
So the ratio `ideal_speedup` is what prefix sharing can gain at best from computing less; measured
throughput ratios also include kernel efficiency, padding, and fixed per-step costs.

A DPO training step is 3x forward for the policy's forward+backward plus 1x forward for the reference
model, with the same sequences on both sides (gradient checkpointing adds one more forward, again on
both sides), so every term scales by the same factor and the ratio of forward FLOPs is the ratio of
step FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prefixdpo.data.example import Example
from prefixdpo.errors import UserError

__all__ = [
    "ModelShape",
    "FlopCount",
    "LLAMA_3_1_8B",
    "forward_flops",
    "standard_sequences",
    "standard_flop_count",
    "shared_flop_count",
    "standard_flops",
    "shared_flops",
    "ideal_speedup",
    "trie_flop_count",
    "step_ideals",
    "step_flop_totals",
]


class FlopCount(NamedTuple):
    """Forward FLOPs split by where they are spent (Python ints: no overflow)."""

    body: int
    attention: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.body + self.attention + self.lm_head

    def __add__(self, other: FlopCount) -> FlopCount:  # type: ignore[override]  (tuple + would concatenate)
        return FlopCount(self.body + other.body, self.attention + other.attention, self.lm_head + other.lm_head)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder that the FLOP count needs."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    attention_layers: int | None = None  # layers with attention (None: all, a plain transformer)
    recurrent_flops_per_token: int = 0  # all recurrent layers' state-update FLOPs per token (hybrids)
    body_params: int | None = None  # the body's weights where no Llama formula holds (pure state-space models)

    @property
    def pair_layers(self) -> int:
        """The layers whose cost grows with attended pairs."""
        return self.layers if self.attention_layers is None else self.attention_layers

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers `PretrainedConfig` (Llama/Mistral/Qwen2-style names).

        Multimodal configs use their text config. `num_key_value_heads` defaults to the head count and
        `head_dim` to hidden / heads, as in the models themselves.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if getattr(config, "model_type", None) in STATE_SPACE_MODEL_TYPES:
            return cls.state_space(config)
        missing = [
            name
            for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if getattr(config, name, None) is None
        ]
        if missing:
            raise UserError(f"model config {type(config).__name__} lacks {', '.join(missing)}: cannot count FLOPs")
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kinds = layer_kinds(config)
        return cls(
            hidden=int(config.hidden_size),
            intermediate=int(config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
            attention_layers=None if kinds is None else sum("attention" in k for k in kinds),
            recurrent_flops_per_token=0 if kinds is None else
            sum("recurrent" in k for k in kinds) * recurrent_layer_flops_per_token(config),
        )

    @classmethod
    def state_space(cls, config) -> ModelShape:
        """A pure state-space model (Mamba, Mamba2, FalconMamba): no attention, every layer a recurrent mixer whose
        projections follow no Llama names, so its body's weights are counted off the model built on the meta device
        (`body_weights`); `intermediate` is the mixers' inner width (expand x hidden), `kv_heads` 0 (no KV cache)."""
        hidden, kinds = int(config.hidden_size), layer_kinds(config)
        return cls(hidden=hidden, intermediate=int(getattr(config, "expand", 2) * hidden), layers=len(kinds),
                   heads=int(getattr(config, "num_heads", None) or 1), kv_heads=0,
                   head_dim=int(getattr(config, "head_dim", None) or 0), vocab=int(config.vocab_size),
                   attention_layers=0, recurrent_flops_per_token=len(kinds) * recurrent_layer_flops_per_token(config),
                   body_params=body_weights(config))

    def body_params_per_token(self) -> int:
        """Weights each token multiplies through in the body (all layers; norms and biases ignored).

        Per layer: q (hidden x heads*head_dim), k and v (hidden x kv_heads*head_dim each), o
        (heads*head_dim x hidden), SwiGLU MLP gate, up and down (3 x hidden x intermediate). `body_params` where
        set (a pure state-space model).
        """
        if self.body_params is not None:
            return self.body_params
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q_o + k_v + mlp)

    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    def flop_fractions(
        self, examples: Iterable[Example | tuple[int, Sequence[int]]], *, shared: bool = True
    ) -> dict[str, float]:
        """Share of forward FLOPs in the body's matmuls, attention, and the LM head for a workload.

        returns {"body": f, "attention": f, "lm_head": f}, summing to 1. For a small model with a large
        vocabulary the LM head dominates, and prefix sharing cannot shrink it (see DESIGN.md lever 3).
        """
        count = FlopCount(0, 0, 0)
        for ex in examples:
            count = count + (shared_flop_count(self, ex) if shared else standard_flop_count(self, ex))
        total = count.total
        if total == 0:
            raise UserError("flop_fractions: empty workload (no examples)")
        return {"body": count.body / total, "attention": count.attention / total, "lm_head": count.lm_head / total}


# pure state-space models: every layer a recurrent mixer (their configs name no layer types)
STATE_SPACE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "attention", "hybrid"}  # falcon_h1: both in one layer
_RECURRENT_TYPES = {"linear_attention", "conv", "mamba", "hybrid"}


def layer_kinds(config) -> list[set[str]] | None:
    """Each layer's kinds ({"attention"}, {"recurrent"}, both, or none for an MLP-only block) from a hybrid config's
    `layer_types` (or NemotronH's `layers_block_type`); None for a plain transformer (no recurrent layer)."""
    if getattr(config, "model_type", None) in STATE_SPACE_MODEL_TYPES:
        return [{"recurrent"} for _ in range(int(config.num_hidden_layers))]
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if not types or not set(types) & _RECURRENT_TYPES:
        return None
    return [{kind for kind, names in (("attention", _ATTENTION_TYPES), ("recurrent", _RECURRENT_TYPES)) if t in names}
            for t in types]


def recurrent_layer_flops_per_token(config) -> int:
    """One recurrent layer's state work per token, by its family's config (its projections are in the body):
    a linear-attention state (Gated DeltaNet, KDA) decays, updates and is read, 3 multiply-adds over dk x dv per
    value head; a Mamba2 state 3 over head_dim x d_state per head (a Mamba 1 state 3 over d_state per inner
    channel); a short convolution 1 per channel and tap."""
    c = config
    if getattr(c, "model_type", None) == "mamba2":  # a pure Mamba2: its mixer's own names
        return 6 * c.num_heads * c.head_dim * c.state_size
    if getattr(c, "model_type", None) in ("mamba", "falcon_mamba"):
        return 6 * c.intermediate_size * c.state_size
    if getattr(c, "linear_num_value_heads", None):  # Qwen3.5 / Qwen3-Next Gated DeltaNet
        return 6 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    if getattr(c, "linear_num_heads", None):  # Kimi Delta Attention
        return 6 * c.linear_num_heads * c.linear_head_dim ** 2
    heads = (getattr(c, "mamba_n_heads", None) or getattr(c, "mamba_num_heads", None)
             or getattr(c, "n_mamba_heads", None))
    if heads:  # Mamba2 (Granite 4, Bamba, Falcon-H1, NemotronH, Zamba2)
        head_dim = (getattr(c, "mamba_d_head", None) or getattr(c, "mamba_head_dim", None)
                    or getattr(c, "mamba_headdim", None))
        state = getattr(c, "mamba_d_state", None) or getattr(c, "ssm_state_size", None)
        return 6 * heads * head_dim * state
    taps = getattr(c, "conv_L_cache", None)  # LFM2 / LFM3 short convolution over the hidden channels
    return 2 * c.hidden_size * (taps or 0)


def body_weights(config) -> int:
    """The weights a token multiplies through in the body of the model `config` describes: every parameter of two
    or more dimensions (matrices, convolution kernels) but the input embeddings and the LM head, counted on the meta
    device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)


# Llama-3.1-8B, the paper's main model: for reports comparing the ideal speedup with its measurements.
LLAMA_3_1_8B = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256)


def forward_flops(shape: ModelShape, tokens: int, allowed_pairs: int, head_positions: int) -> FlopCount:
    """Forward FLOPs of one sequence/row with `tokens` positions, `allowed_pairs` (query, key) pairs
    the attention mask allows (per layer and head), and `head_positions` positions run through the LM head."""
    return FlopCount(
        body=(2 * shape.body_params_per_token() + shape.recurrent_flops_per_token) * tokens,
        attention=shape.pair_layers * 4 * shape.heads * shape.head_dim * allowed_pairs,
        lm_head=2 * shape.lm_head_params() * head_positions,
    )


def _lengths(example: Example | tuple[int, Sequence[int]]) -> tuple[int, list[int]]:
    if isinstance(example, Example):
        return len(example.prompt_ids), [len(r) for r in example.response_ids]
    prompt_len, response_lens = example
    return int(prompt_len), [int(r) for r in response_lens]


def standard_sequences(example: Example | tuple[int, Sequence[int]]) -> tuple[int, list[int]]:
    """(prompt length, response length of every `[prompt][response]` sequence standard DPO runs).

    An Example runs as TRL runs a preference record: one (chosen, rejected) pair of sequences per
    preference pair, so K = 4 responses trained best-vs-each (3 pairs) are 6 sequences, the best
    response 3 times. A (prompt_length, [response lengths]) tuple carries no pairs: each response once
    (for two responses, the one pair).
    """
    p, responses = _lengths(example)
    if isinstance(example, Example):
        responses = [responses[k] for pair in example.pairs for k in pair]
    return p, responses


def standard_flop_count(shape: ModelShape, example: Example | tuple[int, Sequence[int]]) -> FlopCount:
    """Standard DPO: each sequence of `standard_sequences` its own causal [prompt][response] of
    n = P + R tokens, n(n+1)/2 allowed pairs, R LM-head positions (prompt's last token .. response's
    second-to-last).

    example: an Example, or (prompt_length, [response lengths]) for length-only workloads.
    """
    p, responses = standard_sequences(example)
    count = FlopCount(0, 0, 0)
    for r in responses:
        n = p + r
        count = count + forward_flops(shape, n, n * (n + 1) // 2, r)
    return count


def shared_flop_count(shape: ModelShape, example: Example | tuple[int, Sequence[int]]) -> FlopCount:
    """Prefix sharing: one row, prompt once then every response (each once, whatever the pairs); the
    prompt attends causally (P(P+1)/2 pairs) and each response of R tokens to the whole prompt and
    causally to itself (R*P + R(R+1)/2 pairs). LM-head positions: every response token once."""
    p, responses = _lengths(example)
    pairs = p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in responses)
    return forward_flops(shape, p + sum(responses), pairs, sum(responses))


def standard_flops(shape: ModelShape, example: Example | tuple[int, Sequence[int]]) -> int:
    """Total forward FLOPs of standard DPO on one example (see `standard_flop_count`)."""
    return standard_flop_count(shape, example).total


def shared_flops(shape: ModelShape, example: Example | tuple[int, Sequence[int]]) -> int:
    """Total forward FLOPs of the prefix-shared row of one example (see `shared_flop_count`)."""
    return shared_flop_count(shape, example).total


def ideal_speedup(shape: ModelShape, examples: Iterable[Example | tuple[int, Sequence[int]]],
                  shared_rows: Iterable[Example | tuple[int, Sequence[int]]] | None = None) -> float:
    """sum standard FLOPs / sum prefix-shared FLOPs over a workload (>= 1 for pairwise records).

    For K responses paired best-vs-each, standard DPO runs 2(K-1) sequences and the shared row K
    responses once: the ideal grows with K (the saving is the repeated prompt AND the repeated best).

    shared_rows: the same pairs laid out otherwise for the shared side, e.g. `examples` grouped by prompt
    (`data.grouping.group_by_prompt`: one row per prompt, each distinct response once); None = `examples`.

    The training step's 3x (forward + backward) for the policy and 1x reference forward multiply both
    sides by the same factor, so this forward-FLOP ratio is also the step-FLOP ratio.
    """
    examples = list(examples)
    std = sum(standard_flops(shape, ex) for ex in examples)
    shared = sum(shared_flops(shape, ex) for ex in (examples if shared_rows is None else shared_rows))
    if shared == 0:
        raise UserError("ideal_speedup: empty workload (no examples)")
    return std / shared


def trie_flop_count(shape: ModelShape, examples: Sequence[Example]) -> FlopCount:
    """One line of `examples` as a token trie (`data.tree.tree_line`): every token their sequences share with all
    the tokens before it once; each token attends to itself and its ancestors (depth + 1 pairs); the LM head
    once per distinct response-token node (a response two records name, once). What a line of a token trie across
    records computes (`prefix_tree` training, `bench`'s trie-packed mode)."""
    from prefixdpo.data.tree import tree_line

    line = tree_line(examples)
    sequences = iter(line.sequences)
    targets = set()  # response-token nodes: as `shared_flop_count`, the head once per distinct response token
    for ex in examples:
        p = len(ex.prompt_ids)
        for _ in ex.response_ids:
            targets.update(next(sequences)[p:])
    return forward_flops(shape, len(line), sum(d + 1 for d in line.position_ids), len(targets))


def step_flop_totals(shape: ModelShape, steps: Sequence[Sequence[Example]], keep=None) -> dict[str, int]:
    """Useful forward FLOPs of the records of each optimizer step in `steps`, summed, per layout:

    standard:   each pair's two sequences on their own (`standard_flop_count`);
    per_record: each record its own prefix-shared row (`shared_flop_count`);
    grouped:    a step's records of one prompt in one row (`group_by_prompt`), each distinct response once;
    trie:       a step's records in one line as a token trie (`trie_flop_count`).

    keep: FlopCount -> FlopCount applied to every count (a reward model drops the LM head); None = all of it.
    """
    from prefixdpo.data.grouping import group_by_prompt

    keep = keep or (lambda count: count)
    totals = dict.fromkeys(("standard", "per_record", "grouped", "trie"), 0)
    for step in steps:
        grouped, _ = group_by_prompt(step)
        totals["standard"] += sum(keep(standard_flop_count(shape, ex)).total for ex in step)
        totals["per_record"] += sum(keep(shared_flop_count(shape, ex)).total for ex in step)
        totals["grouped"] += sum(keep(shared_flop_count(shape, ex)).total for ex in grouped)
        totals["trie"] += keep(trie_flop_count(shape, step)).total
    return totals


def step_ideals(shape: ModelShape, steps: Sequence[Sequence[Example]], keep=None) -> dict[str, float]:
    """Useful-FLOP speedups over standard DPO of the layouts of `step_flop_totals` (per_record, grouped, trie)."""
    totals = step_flop_totals(shape, steps, keep)
    if totals["per_record"] == 0:
        raise UserError("step_ideals: empty workload (no examples)")
    return {name: totals["standard"] / totals[name] for name in ("per_record", "grouped", "trie")}
