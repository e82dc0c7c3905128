"""`prefixdpo verify --task grpo`: the prefix-shared group pass against TRL's `GRPOTrainer` pass on the user's model
(or the embedded default of `prefixdpo grpo`), one line per case and a verdict (`prefixdpo.grpo.verify` holds the
comparison)."""

from __future__ import annotations

import sys
import tempfile

import torch

from prefixdpo.core.logprobs import UnsupportedModelError
from prefixdpo.core.model_checks import check_model_supported
from prefixdpo.core.models import load_causal_lm, load_tokenizer
from prefixdpo.core.verify import stock_implementation
from prefixdpo_tools.demo_grpo import build_group_demo
from prefixdpo.grpo.verify import DEFAULT_GROUPS, group_rows, read_groups, run_group_verify


def _load_model_and_tokenizer(args, dtype, folder: str):
    """(model on args.device in eval mode, tokenizer, its name for the report): `--model`, or the embedded default
    of `prefixdpo grpo` built into `folder`."""
    name = args.model
    if name is None:
        name = str(build_group_demo(folder, num_prompts=64).model_dir)
        label = "the embedded default of prefixdpo grpo"
    else:
        label = args.model
    tokenizer = load_tokenizer(args.tokenizer or name, trust_remote_code=args.trust_remote_code)
    model = load_causal_lm(name, dtype=dtype, trust_remote_code=args.trust_remote_code).to(args.device)
    return model.train(False), tokenizer, label


def run_verify_command(args, *, backend: str, dtype: torch.dtype, logp_tol: float, grad_tol: float) -> int:
    """`prefixdpo verify --task grpo`: print one line per case and the verdict; 0 if every case is within
    tolerance, 1 if not, 2 if the model is one prefix sharing refuses (one line naming the feature)."""
    with tempfile.TemporaryDirectory(prefix="prefixdpo-verify-grpo-") as tmp:
        model, tokenizer, label = _load_model_and_tokenizer(args, dtype, tmp)
        try:
            check_model_supported(model, backend)
        except UnsupportedModelError as err:
            hint = "" if args.device.startswith("cuda") else "; verify it with --device cuda --attention flex"
            print(f"prefixdpo verify: error: {err}{hint}", file=sys.stderr)
            return 2
        groups = read_groups(args.text_file) if args.text_file else DEFAULT_GROUPS
        rows = group_rows(tokenizer, groups)
        requested = args.attention if args.attention == backend else f"{args.attention} -> {backend}"
        print(f"prefixdpo verify --task grpo: {type(model).__name__} ({label}), {args.dtype}, attention={requested}; "
              f"{rows.describe()}; TRL's pass: GRPOTrainer._get_per_token_logps_and_entropies with the model's "
              f"{stock_implementation(model)} attention")
        print(f"tolerances: per-token logp and entropy |ours - TRL's| <= {logp_tol:g} x max(1, largest |value|); "
              f"gradient of sum(w1 logp + w2 entropy), random w, <= {grad_tol:g} x max(1, largest gradient entry)")
        print(f"{'case':40} {'max |dlogp|':>12} {'max |dentropy|':>14} {'max |dgrad|':>12} {'tokens run':>16}  result")
        failed = False
        for result in run_group_verify(model, tokenizer, backend, rows):
            ok = result.ok(logp_tol, grad_tol)
            failed |= not ok
            tokens = f"{result.tokens_shared}/{result.tokens_trl}"
            print(f"{result.case:40} {result.logp_diff:12.3e} {result.entropy_diff:14.3e} {result.grad_diff:12.3e} "
                  f"{tokens:>16}  {'ok' if ok else 'FAIL'}")
    print("tokens run: real tokens of the prefix-shared lines / of TRL's rows (each prompt once instead of G times)")
    print("verdict: " + ("FAIL: the prefix-shared pass does not match TRL's" if failed else
                         "the prefix-shared pass matches TRL's"))
    return 1 if failed else 0
