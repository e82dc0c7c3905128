"""FlashAttention-varlen attention for prefix-shared lines: no padding, no mask, one kernel call per layer.

The segments are those of `attention/segments.py` (`segments.line_segments`): each run of tokens whose parent is the
token before it, its keys the run's ancestors then the run, causal aligned bottom-right (for a prefix-shared
example: the prompt and the first response one causal sequence, every later response k its own queries over the
gathered keys `[prompt][response k]`). FlashAttention's varlen kernel takes all segments of
the batch packed end to end, with separate cumulative lengths for queries and keys, so each segment
computes only its allowed blocks and nothing is padded.

`torch.nn.attention.varlen.varlen_attn` changed between releases; its signature is read at call time:
- torch >= 2.13: `window_size=(-1, 0)` for causal (bottom-right), `enable_gqa`, `scale`; a sliding layer's window w
  as `window_size=(w - 1, 0)`: a segment's keys are its sequence's tokens in order (the run's ancestors from the root,
  then the run), so key j sits at position j and a query at nk - nq + i, and FlashAttention keeps the keys from
  `q - (w - 1)` to `q` (transformers' `kv_idx > q_idx - sliding_window`);
- torch 2.11: `is_causal=True` (FlashAttention aligns it bottom-right too), no `enable_gqa` (K/V heads
  are expanded here), and possibly no `scale` (the query is pre-scaled instead).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from prefixdpo.core.attention.segments import line_segments
from prefixdpo.errors import ConfigError

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.11: the backend is refused by `check_available`
    varlen_attn = None

# FlashAttention's CUDA kernels compute in half precision only.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class VarlenPlan:
    """The packed segments of a [B, L] batch, shared by every layer (and by the reference pass).

    q_index:   [Tq] flat token index (b * L + t) of every query, segments end to end (Tq = real tokens)
    kv_index:  [Tk] flat token index of every key/value, segments end to end (prompts repeat per response)
    cu_seq_q:  [N + 1] int32 cumulative query counts of the N segments
    cu_seq_k:  [N + 1] int32 cumulative key counts
    max_q, max_k: the longest segment's query and key counts (python ints: the kernel needs them on host)
    out_index: [B * L] row of the packed output holding each token's result; padding tokens point at an
               extra all-zero row (index Tq) so they get zeros
    """

    batch_size: int
    length: int
    q_index: torch.Tensor
    kv_index: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int
    out_index: torch.Tensor

    @property
    def num_segments(self) -> int:
        return self.cu_seq_q.numel() - 1


def build_varlen_plan(spans: torch.Tensor, queries_from: int = 0) -> VarlenPlan:
    """Plan varlen attention for lines' [B, L, 2] spans ((tin, tout); (-1, -1) = padding): the segment plan's
    segments (`segments.line_segments`; queries_from: its queries from that column on), packed end to end."""
    B, L, _ = spans.shape
    return _packed_plan(line_segments(spans.cpu(), queries_from), B, L - queries_from, spans.device)


def _packed_plan(segs: list[tuple[list[int], list[int]]], B: int, L: int, device) -> VarlenPlan:
    """The VarlenPlan of (query flat indices, key flat indices) segments of a [B, L] batch, in their order."""
    q_index: list[int] = []
    kv_index: list[int] = []
    cu_q, cu_k = [0], [0]
    for queries, keys in segs:
        q_index.extend(queries)
        kv_index.extend(keys)
        cu_q.append(len(q_index))
        cu_k.append(len(kv_index))
    out_index = [len(q_index)] * (B * L)
    for row, token in enumerate(q_index):
        out_index[token] = row

    def as_tensor(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return VarlenPlan(
        B, L, as_tensor(q_index), as_tensor(kv_index),
        as_tensor(cu_q, torch.int32), as_tensor(cu_k, torch.int32),
        max((len(q) for q, _ in segs), default=0), max((len(k) for _, k in segs), default=0),
        as_tensor(out_index),
    )


def check_available(device: torch.device) -> None:
    """Raise a one-line ConfigError unless `attention='varlen'` can run on `device`."""
    if device.type != "cuda":
        raise ConfigError(
            f"attention='varlen' needs a CUDA device (FlashAttention varlen); this run is on {device.type}: "
            "use 'segmented' or 'sdpa'"
        )
    if varlen_attn is None:
        raise ConfigError(
            f"attention='varlen' needs torch.nn.attention.varlen (torch >= 2.11); torch {torch.__version__} "
            "lacks it: use 'flex'"
        )


class UnsupportedDtypeError(ConfigError):
    """The varlen kernel cannot compute in the model's dtype (a fact of the backend, not of the user's data)."""


def check_dtype(dtype: torch.dtype) -> None:
    """Raise a one-line `UnsupportedDtypeError` unless FlashAttention varlen computes in `dtype`."""
    if dtype not in _FLASH_DTYPES:
        raise UnsupportedDtypeError(
            f"attention='varlen' runs FlashAttention, which computes in bfloat16/float16 only; the model "
            f"runs in {dtype}: use --bf16 (or a bfloat16 model), or attention 'flex' for {dtype}"
        )


@functools.lru_cache(maxsize=4)
def _kernel_parameters(kernel) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def slides_windows() -> bool:
    """Whether this torch's varlen kernel takes a window (`window_size`, torch >= 2.13; module docstring)."""
    return varlen_attn is not None and "window_size" in _kernel_parameters(varlen_attn)


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan,
    *, scaling: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """query [B, H, L, D], key/value [B, Hkv, L, D] -> output [B, L, H, Dv] (transformers' layout); window: a
    sliding layer's (module docstring).

    One gather for the queries, one for keys/values, one varlen call, one gather back; `index_select`
    for the reasons given in `segments.segmented_attention`. Padding positions get zeros.
    """
    if query.device.type == "cuda":
        check_dtype(query.dtype)
    B, H, L, D = query.shape
    Hkv, Lk, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if plan.num_segments == 0:  # all padding (a rank-balancing empty micro-batch)
        return query.new_zeros(B, L, H, Dv)
    q = query.transpose(1, 2).reshape(B * L, H, D).index_select(0, plan.q_index)  # [Tq, H, D]
    k = key.transpose(1, 2).reshape(B * Lk, Hkv, D).index_select(0, plan.kv_index)  # [Tk, Hkv, D]
    v = value.transpose(1, 2).reshape(B * Lk, Hkv, Dv).index_select(0, plan.kv_index)  # [Tk, Hkv, Dv]

    params = _kernel_parameters(varlen_attn)
    options = {}
    if window is not None and window >= plan.max_k:  # no segment is longer than the window: it cuts nothing
        window = None
    if "window_size" in params:
        # causal, aligned bottom-right for a shorter query block; a sliding layer keeps its window's keys
        options["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise ConfigError(f"attention='varlen' on torch {torch.__version__} takes no window (its varlen kernel has "
                          "no window_size): a sliding-window layer needs --attention sdpa or flex")
    else:
        options["is_causal"] = True
    if Hkv != H:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # query head h reads kv head h // (H // Hkv), as SDPA's enable_gqa and transformers' repeat_kv
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
    if scaling is not None:
        if "scale" in params:
            options["scale"] = scaling
        else:  # the kernel's own scale is 1/sqrt(D)
            q = q * (scaling * D**0.5)

    out = varlen_attn(q, k, v, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, **options)  # [Tq, H, Dv]
    return torch.cat([out, out.new_zeros(1, H, Dv)]).index_select(0, plan.out_index).view(B, L, H, Dv)
