"""The one rule for comparing two computations of the same math (two layouts, two engines, ours and TRL's, a run
and its resume):

    |a - b| <= k x eps(dtype) x scale

eps is the dtype's machine epsilon (`EPS32` 1.19e-7, `EPS64` 2.22e-16). scale is the magnitude of the quantities
whose rounding reaches the compared value, never the compared value itself (a DPO loss near log 2 is small while the
log-prob sums it is made of are ~100):
- log-prob sums: the largest |sum| (sums of negative terms: nothing cancels);
- a DPO-family loss or reward: its slope in the sums (beta for sigmoid DPO) x a pair's four sums' mean |sum|
  (`dpo_loss_scale`, read off the logged means; the loss is a mean over pairs);
- a loss from a formula: |L| + 2 sum_i |dL/dx_i| |x_i| over its inputs (test_losses.loss_scale);
- a reward score: |w| |h| of the head's dot product, whose terms cancel (test_reward_scores.score_scale);
- gradients: their largest entry; read off an SGD step, (start - trained) / lr, plus max|w| / lr (`sgd_grad_scale`);
- weights after steps: the largest start weight plus the largest total move (`weights_scale`).

k, argued once. Two computations of the same math differ only in how their reductions are grouped (which rows,
which lengths, which vector width the CPU capability picks); each is within its own rounding of the exact value.
- K_FORWARD = 8: a value of forward passes (log-prob sums, scores, logits, the losses and rewards made of them; also
  after SGD steps, which leave two runs' weights a few ulps apart). A sum's rounding is that of its last reductions
  (logsumexp over <= ~300 logits, the sum over <= ~100 tokens: ~log2 n ulps of |sum| each), the deeper layers'
  entering through O(1) slopes; 8 is the log-prob tests' 1e-6 x scale. Worst measured over the suite (AVX-512,
  AVX2, ATen default): 3.0 (reward scores), 1.5 in float64.
- K = 128: gradients, weights, and values after Adam steps. A gradient entry sums every token's contribution through
  the whole backward, ~20 blocked reductions on its longest path in these tiny models (hidden 32, MLP 64, 2 layers,
  rows <= 1024: the token sum of a weight's gradient, attention over <= 1024 keys, projections, norms, MLP, head,
  logsumexp), each exact to ~log2 n + 1 ulps of the sum of |terms| it reduces: 2 x (11 + 11 + 6 + 6 + 7 + 6) + 11 +
  6 + 9 ~ 120, the first-order bound with every rounding aligned. Adam divides each entry's step by the entry's own
  size, so rounding in an entry near 0 becomes a step of up to lr. 128 eps is 1.5e-5 x scale in fp32 (STANDARDS'
  "~1e-5 x scale"). Worst measured: 36 (RLOO's grad_norm after 4 steps, vs TRL), 33 (the 3-turn tree step), 15 in
  float64.
Both stay far below a real layout error (a token's log-prob missing or a key attended wrongly moves a sum by ~1 nat,
~1e5 eps x scale). A float64 run of the same comparison (`float64_model`) uses the same k with EPS64: agreement
there shows the fp32 difference is rounding only.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
K = 128  # a value downstream of a backward pass or an Adam step: gradients, weights
K_FORWARD = 8  # a value of forward passes compared directly: log-prob sums, scores, logits, their losses


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def bound(scale: float, dtype: torch.dtype = torch.float32, k: float = K) -> float:
    """k x eps(dtype) x scale: how far two computations of the same math may be apart."""
    return k * eps(dtype) * scale


def max_diff(a, b) -> float:
    """Largest |a - b| of two numbers, tensors or equal-length sequences."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return (a - b).abs().max().item()


def assert_within(a, b, scale: float, dtype: torch.dtype = torch.float32, k: float = K, what: str = "") -> float:
    """Asserts max |a - b| <= k x eps(dtype) x scale; returns the difference in units of eps x scale."""
    return assert_small(max_diff(a, b), scale, dtype, k, f"{what} (a {_head(a)}, b {_head(b)})")


def assert_small(diff: float, scale: float, dtype: torch.dtype = torch.float32, k: float = K, what: str = "") -> float:
    """Asserts a measured difference <= k x eps(dtype) x scale; returns it in units of eps x scale."""
    limit = bound(scale, dtype, k)
    assert diff <= limit, f"{what}: |a - b| = {diff:.3g} > bound {limit:.3g} = {k} x eps({dtype}) x scale {scale:.4g}"
    return diff / (eps(dtype) * scale) if diff else 0.0


def assert_logged_loss_within(a: float, b: float, scale: float, dtype: torch.dtype = torch.float32,
                              what: str = "logged loss") -> float:
    """Two logged training losses within K_FORWARD eps x `scale`; in a float64 run within one float32 rounding of
    their size instead: HF's Trainer accumulates the logged loss in a float32 tensor."""
    if dtype == torch.float32:
        return assert_within(a, b, scale, k=K_FORWARD, what=what)
    return assert_within(a, b, abs(b), torch.float32, k=1, what=f"{what} (float32 in HF's Trainer)")


def _head(x) -> str:
    t = torch.as_tensor(x, dtype=torch.float64).flatten()
    return f"{t[0].item():.9g}" if t.numel() == 1 else f"[{t.numel()}] first {t[0].item():.9g}"


def assert_matches_separate_passes(result, dtype: torch.dtype = torch.float32) -> None:
    """A `prefixdpo.core.verify.VerifyResult` (or the reward scores' one): the sums (scores) within K_FORWARD of
    their largest |value|, the gradients (where compared) within K of their largest entry."""
    assert_small(result.logp_diff, result.logp_scale, dtype, K_FORWARD, f"{result.case} sums")
    if result.grad_diff is not None:
        assert_small(result.grad_diff, result.grad_scale, dtype, K, f"{result.case} gradients")


def dpo_loss_scale(log: dict, beta: float, prefix: str = "", slope: float | None = None) -> float:
    """beta x the mean |log-prob sum| of a pair's four sums (policy and reference, chosen and rejected), from a
    logged step or evaluation of a DPO-family loss with a reference: the logged `logps/*` are the policy's means
    (all sums are negative, so |mean| is the mean of |sum|) and `rewards/* = beta x (policy - reference)` gives the
    reference's. Sigmoid DPO's slope in the margin is at most beta, and the loss is a mean over pairs, so a rounding
    of each sum by eps x |sum| moves it by at most beta x (the four sums' mean |sum|) x eps. `slope`: another
    loss's largest slope in its sums (default beta)."""
    policy = [log[f"{prefix}logps/{side}"] for side in ("chosen", "rejected")]
    reference = [p - log[f"{prefix}rewards/{side}"] / beta for p, side in zip(policy, ("chosen", "rejected"))]
    return (beta if slope is None else slope) * sum(abs(x) for x in policy + reference)


def assert_same_dpo_log(a: dict, b: dict, beta: float, keys, prefix: str = "", slope: float | None = None,
                        dtype: torch.dtype = torch.float32, k: float = K_FORWARD, what: str = "") -> float:
    """`b` against `a`, two logs of the same DPO-family step or evaluation, on `keys` (without `prefix`): the loss
    and rewards/* within k eps x `dpo_loss_scale(a, beta, prefix, slope)`, logps/* within k eps of the larger
    |mean sum|, token fractions (prefix_sharing/*, packing/*) within k eps of 1. Returns the worst in eps x scale."""
    scales = {"loss": dpo_loss_scale(a, beta, prefix, slope),
              "logps": max(abs(a[f"{prefix}logps/{side}"]) for side in ("chosen", "rejected"))}
    worst = 0.0
    for key in keys:
        kind = key.split("/")[0]
        scale = scales["loss"] if kind in ("loss", "rewards") else scales.get(kind, 1.0)
        worst = max(worst, assert_within(b[prefix + key], a[prefix + key], scale, dtype, k, f"{what} {key}"))
    return worst


def assert_same_weights(a: dict, b: dict, k: float = K_FORWARD, what: str = "weights") -> float:
    """Two runs' named weights {name: tensor} of the same steps (a resume, the same steps without a skipped one)
    within k eps x the largest |weight| of `b` (K_FORWARD: the same computations, a few ulps at most)."""
    assert a.keys() == b.keys() and a
    diff = max(float((a[n].detach().double() - b[n].detach().double()).abs().max()) for n in b)
    return assert_small(diff, max(float(b[n].detach().abs().max()) for n in b), k=k, what=what)


def sgd_grad_scale(grad: torch.Tensor, start: torch.Tensor, lr: float) -> float:
    """The scale of a gradient read off one SGD step, (start - trained) / lr: its largest entry, plus the weights'
    own rounding (max|w| / lr) that the subtraction carries."""
    return grad.abs().max().item() + start.abs().max().item() / lr


def in_dtype(model, dtype: torch.dtype):
    """The fp32 tiny model as it is, or `float64_model` of it."""
    return model if dtype == torch.float32 else float64_model(model)


def weights_scale(start: torch.Tensor, trained: torch.Tensor) -> float:
    """The scale trained weights [N] carry rounding in: the largest start weight plus the largest total move."""
    return start.abs().max().item() + (trained - start).abs().max().item()


def float64_model(model):
    """`model` in float64 with every RMSNorm computing in float64: transformers' RMSNorms (Llama, Qwen, Mistral,
    Mixtral) cast their input to float32 and back, which in a float64 model rounds activations and, in backward,
    the gradient to float32 at every norm; two layouts that sum a shared prompt token's gradient in different
    groupings then differ by float32 rounding. Rotary cos/sin stay float32 constants, equal in every layout."""
    import types

    model = model.double()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_float64, module)
    return model


def _rms_norm_float64(self, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm in the input's dtype. hidden [..., D]."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))
