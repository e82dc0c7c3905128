"""The one rule for comparing two computations of the same math (two layouts, two engines, ours and TRL's):

    |a - b| <= K x eps x scale

eps is the unit roundoff's double of the dtype computed in (`EPS32` 1.19e-7, `EPS64` 2.22e-16); scale is the
magnitude of the quantities whose rounding reaches the compared value, never the compared value itself (a DPO loss
near log 2 is small while the log-prob sums it comes from are ~100):
- log-prob sums: the largest |sum| compared;
- a DPO-family loss (a mean over pairs): beta (its slope in the margin is at most beta) x the mean |log-prob sum|
  of the four sums of a pair (`dpo_loss_scale`, read off the logged means);
- gradients: their largest entry; gradients read off an SGD step of `lr`, (start - trained) / lr, also carry the
  rounding of the weights themselves, max|w| / lr (`sgd_grad_scale`);
- weights after n steps: max|w| + lr x the largest update.

K = 64, argued once: two layouts differ only in how their reductions are grouped (which rows, which lengths, which
vector width the CPU capability picks) and each is within its own rounding of the exact value, so their difference
is at most twice one computation's error. In the tiny models of these tests (hidden 32, MLP 64, 2 layers, head dim
8, rows <= 1024, vocabulary <= ~300, responses <= ~100 tokens) the longest path from the weights to a log-prob sum
passes ~20 blocked reductions (norms, projections, scores, softmax, values, MLP, head, logsumexp, the token sum),
each exact to ~(log2 n + 1) ulps of the sum of |terms| it reduces: a first-order worst case of a few hundred eps
with every error aligned, and of order sqrt of that (~15-20 eps) for independent roundings. Measured across
AVX-512, AVX2 and ATen's default kernels, fp32: log-prob sums <= 0.9 eps x scale, gradients <= 8 eps x their
largest entry, logged losses <= 0.05 eps x `dpo_loss_scale`. K = 64 (7.6e-6 x scale in fp32) keeps 8x over the
worst measured on three CPUs' kernels and stays far below any real layout error (a token's log-prob missing or
attending to the wrong key moves a sum by ~1 nat, 1e5 eps x scale). A float64 run of the same comparison uses the
same K with EPS64 (1.4e-14 x scale): agreement there shows the fp32 difference is rounding only.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
K = 64  # a value downstream of a backward pass or an optimizer step: gradients, weights, losses after a step
K_FORWARD = 8  # a value of one forward pass compared directly: log-prob sums, scores, logits, their losses


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
    diff = max(float((a[n].double() - b[n].double()).abs().max()) for n in b)
    return assert_small(diff, max(float(b[n].abs().max()) for n in b), k=k, what=what)


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
