"""`prefixdpo verify`: check prefix sharing against separate standard passes on your own model."""

from __future__ import annotations

import argparse
import sys

from prefixdpo.errors import UserError

DEFAULT_PROMPTS = [
    "The committee met on Tuesday to review the budget. After a long discussion about priorities,",
    "Question: What is the capital of France, and why did it become the capital?\nAnswer:",
    "Here is a short story about a lighthouse keeper who finds a message in a bottle.",
]
DEFAULT_RESPONSES = [
    " they agreed to fund the library first.",
    " nobody could agree, so they postponed the vote.",
    " Paris, because of its central position and royal history.",
    " Lyon, since it is the largest city in France.",
    " The keeper opened it and read a map.",
    " It was empty.",
    " The message was from his own childhood.",
    " Nothing happened that day or the next.",
]

# the tree case: every record behind this system prompt, one record per pair (records of a prompt share it)
DEFAULT_SYSTEM_PROMPT = "System: you are a careful assistant. Answer briefly and truthfully.\n"
TREE_CASE = "trie (system prompt + shared prompts)"

# prefixdpo.core.attention.backends.BACKENDS, spelled out so that building the command line imports no torch
# (tested equal)
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "segmented", "varlen")


DTYPES = ("bfloat16", "float16", "float32")  # core.verify.DTYPE_TOLERANCES' keys; importing it here would load torch


# the command's line in `prefixdpo --help`, and the head of its own help
SUMMARY = "check prefix-shared log-probs and gradients against separate passes on your model"
DESCRIPTION = (
    "Builds prefix-shared and packed rows (K=2 and K=4), standard sequences packed without sharing, and a "
    "token trie (each pair a record of its own, every record behind one system prompt), "
    "from built-in or given text, and compares "
    "per-response log-probs and the gradient of a DPO loss against separate standard forward passes "
    "(--task reward: reward-model scores and the gradient of a Bradley-Terry loss; --task grpo: the per-token "
    "log-probs, entropies and their gradients of a GRPO group batch against TRL's own pass). "
    "Exits 1 if a difference is above tolerance, 2 on bad input (or a backend this device cannot run)."
)


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help=SUMMARY, description=DESCRIPTION)
    p.add_argument("--model", default=None, help="model directory or hub name (AutoModelForCausalLM; with --task "
                                                 "reward: AutoModelForSequenceClassification, num_labels=1); "
                                                 "required, except with --task grpo (default: the embedded default of "
                                                 "`prefixdpo grpo`)")
    p.add_argument("--task", default="dpo", choices=["dpo", "reward", "grpo"],
                   help="dpo: per-response log-probs and a DPO loss's gradients; reward: reward-model scores "
                        "(the last token of each response) and a Bradley-Terry loss's gradients; grpo: per-token "
                        "log-probs and entropies of G completions per prompt (left-padded prompts, completions "
                        "ending at EOS or cut at max length) and their gradients, against TRL's GRPOTrainer pass")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="backend to check: auto (flex on CUDA, sdpa elsewhere), sdpa, flex (CUDA), segmented, "
                        "varlen (CUDA + FlashAttention varlen); one that cannot run on --device is refused")
    p.add_argument("--logp-tol", type=float, default=None, help="relative tolerance on per-response log-prob sums")
    p.add_argument("--grad-tol", type=float, default=None, help="tolerance on gradients, relative to the largest entry")
    p.add_argument("--text-file", default=None,
                   help="file of lines 'prompt<TAB>response<TAB>response...' to use instead of the built-in text "
                        "(--task grpo: the completions of each prompt)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code (off by default)")
    p.add_argument("--no-restart-positions", action="store_true",
                   help=argparse.SUPPRESS)  # self-test: a deliberately broken layout must fail the check
    p.set_defaults(func=run)


def attention_label(requested: str, backend: str) -> str:
    """`sdpa`, or `auto -> sdpa` where the backend was resolved from `auto`."""
    return backend if requested == backend else f"{requested} -> {backend}"


def _examples(tokenizer, text_file: str | None):
    from prefixdpo.data.example import Example
    from prefixdpo.data.loading import read_tab_groups

    if text_file:
        groups = read_tab_groups(text_file, "responses")
    else:
        groups = [
            (DEFAULT_PROMPTS[0], DEFAULT_RESPONSES[0:2]),
            (DEFAULT_PROMPTS[1], DEFAULT_RESPONSES[2:4]),
            (DEFAULT_PROMPTS[2], DEFAULT_RESPONSES[4:8]),  # K = 4
        ]

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    examples = []
    for i, (prompt, responses) in enumerate(groups):
        pairs = [(0, k) for k in range(1, len(responses))]
        examples.append(Example(bos + enc(prompt), [enc(r) for r in responses], pairs=pairs, source_index=i))
    return examples


def _tree_examples(tokenizer, examples):
    """The tree case's records: each example's pairs as records of their own (a prompt named by several records, a
    response by several), every prompt behind `DEFAULT_SYSTEM_PROMPT`: a trie of depth 2 and more."""
    from prefixdpo.data.example import Example

    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    system = tokenizer(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)["input_ids"]
    records = []
    for ex in examples:
        prompt = bos + system + list(ex.prompt_ids[len(bos):])
        for i, j in ex.pairs:
            records.append(Example(prompt, [ex.response_ids[i], ex.response_ids[j]], pairs=[(0, 1)],
                                   source_index=ex.source_index))
    return records


def resolve_attention(attention: str, device: str) -> str:
    """The backend `--attention` names on `--device`, or a one-line `UserError` where it cannot run there: every
    comparison needs a backward, which FlexAttention lacks on CPU (and torch's CPU compile of it fails on some
    shapes), and varlen needs CUDA with FlashAttention varlen."""
    import torch

    from prefixdpo.core.attention.backends import resolve_backend

    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available")
    if attention == "flex" and where.type != "cuda":
        raise UserError(f"--attention flex cannot run on {where.type}: FlexAttention has no backward there, and "
                        "gradients are part of the check; use --device cuda, or --attention sdpa / segmented")
    try:
        return resolve_backend(attention, where, needs_grad=True)
    except ValueError as err:  # varlen's ConfigError names the device or the missing kernel
        raise UserError(f"--attention {attention}: {err}") from None


def _tolerances(args) -> tuple[float, float]:
    """(log-prob or score, gradient) tolerance: the dtype's (`core.verify.DTYPE_TOLERANCES`) unless given."""
    from prefixdpo.core.verify import DTYPE_TOLERANCES

    logp_tol, grad_tol = DTYPE_TOLERANCES[args.dtype]
    return (args.logp_tol if args.logp_tol is not None else logp_tol,
            args.grad_tol if args.grad_tol is not None else grad_tol)


def _run_grpo(args, backend: str, dtype, logp_tol: float, grad_tol: float) -> int:
    try:
        from prefixdpo.commands.verify_grpo import run_verify_command
    except ModuleNotFoundError as err:
        if err.name != "trl":
            raise
        raise UserError("--task grpo compares against TRL's GRPOTrainer: install trl (1.16)") from None
    return run_verify_command(args, backend=backend, dtype=dtype, logp_tol=logp_tol, grad_tol=grad_tol)


def _load(args, dtype):
    """(model in eval mode on --device, tokenizer, the quantity compared, the comparison): a causal LM and
    `core.verify.compare`, or (--task reward) a one-label sequence classifier and `reward.verify.compare_scores`."""
    from prefixdpo.core.models import load_causal_lm, load_tokenizer
    from prefixdpo.core.verify import compare

    tokenizer = load_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    quantity, compare_fn = "logp", compare
    if args.task == "reward":
        import functools

        from prefixdpo.reward.verify import compare_scores, load_for_verify

        model, pad = load_for_verify(args.model, tokenizer, dtype=dtype, device=args.device,
                                     trust_remote_code=args.trust_remote_code)
        quantity, compare_fn = "score", functools.partial(compare_scores, pad_token_id=pad)
    else:
        model = load_causal_lm(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code).to(args.device)
    model.train(False)  # dropout off: both sides must compute the same function
    return model, tokenizer, quantity, compare_fn


def _cases(model, tokenizer, text_file: str | None, backend: str) -> list[tuple]:
    """(name, examples, packs, prefix_sharing, tree) of every case; a line over the model's positions is refused
    in one line."""
    from prefixdpo.core.fit import check_positions

    examples = _examples(tokenizer, text_file)
    check_positions(model, examples, text_file or "built-in", backend)
    n = len(examples)
    cases = [
        ("unpacked (one row per example)", examples, None, True, False),
        ("packed (all examples in one row)", examples, [list(range(n))], True, False),
        ("packed (two rows, with padding)", examples,
         [list(range(0, n, 2)), list(range(1, n, 2))] if n > 1 else [[0]], True, False),
        ("standard sequences packed, no sharing", examples, [list(range(n))], False, False),
    ]
    records = _tree_examples(tokenizer, examples)
    check_positions(model, records, text_file or "built-in", backend)
    return cases + [(TREE_CASE, records, None, True, True)]


def run(args) -> int:
    import torch

    backend = resolve_attention(args.attention, args.device)  # refused before any model is loaded
    dtype = getattr(torch, args.dtype)
    logp_tol, grad_tol = _tolerances(args)
    if args.task == "grpo":
        return _run_grpo(args, backend, dtype, logp_tol, grad_tol)
    if args.model is None:
        raise UserError(f"--task {args.task} needs --model (only --task grpo has an embedded default)")

    from prefixdpo.core.logprobs import UnsupportedModelError
    from prefixdpo.core.model_checks import check_model_supported
    from prefixdpo.core.verify import stock_implementation

    model, tokenizer, quantity, compare_fn = _load(args, dtype)
    cases = _cases(model, tokenizer, args.text_file, backend)
    examples = cases[0][1]
    try:
        check_model_supported(model, backend)
    except UnsupportedModelError as err:  # one line naming the feature
        hint = "" if args.device.startswith("cuda") else "; verify it with --device cuda --attention flex"
        print(f"prefixdpo verify: error: {err}{hint}", file=sys.stderr)
        return 2
    print(f"prefixdpo verify: {type(model).__name__} ({args.model}), {args.dtype}, "
          f"attention={attention_label(args.attention, backend)}, {len(examples)} examples, "
          f"K = {sorted({e.num_responses for e in examples})}; stock passes: {stock_implementation(model)} attention")
    print(f"tolerances: {quantity} |ours - separate| <= {logp_tol:g} x max(1, largest |{quantity}|); "
          f"gradient <= {grad_tol:g} x max(1, largest gradient entry)")
    print(f"{'case':38} {f'max |d{quantity}|':>12} {'max |dgrad|':>12}  result")
    failed = False
    for name, case_examples, packs, sharing, tree in cases:
        result = compare_fn(model, case_examples, packs=packs, backend=backend, case=name,
                            pad_multiple=128 if backend == "flex" else 1,
                            restart_positions=not args.no_restart_positions, prefix_sharing=sharing, tree=tree)
        ok = result.ok(logp_tol, grad_tol)
        failed |= not ok
        grad = "n/a" if result.grad_diff is None else f"{result.grad_diff:.3e}"
        print(f"{name:38} {result.logp_diff:12.3e} {grad:>12}  {'ok' if ok else 'FAIL'}")
    print("verdict: " + ("FAIL: prefix sharing does not match separate passes" if failed else
                         "prefix sharing matches separate passes"))
    return 1 if failed else 0
