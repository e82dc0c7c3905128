"""`prefixdpo train [config.yaml] [--model M] [--dataset D] [--output-dir DIR] [--any-config-option V ...]`.

Without `--model` the model is the embedded default (a small Llama built locally, `prefixdpo.demo`);
without `--dataset` the data is the default's generated preference set. With neither, the run uses
hyper-parameters suited to that random-init model (any of them can still be overridden); this is what
`make demo` runs. Every other option is a `PrefixDPOConfig` / `ModelArguments` / `DataArguments` field,
spelled with dashes or underscores, from the YAML file or the command line (command line wins).
"""

from __future__ import annotations

import os
import sys
import time

# Hyper-parameters for the embedded default's random-init model; each applies only when neither the
# YAML file nor the command line sets it. DPO from random init sits near chance for ~50-100 steps
# before the policy learns to read the instruction, so: a large constant learning rate, no gradient
# clipping (clipping at 1.0 roughly halved progress in the measured runs), two epochs (250 steps).
DEMO_DEFAULTS: dict[str, str] = {
    "output_dir": "prefixdpo-output/demo",  # under the git-ignored default output folder
    "learning_rate": "2e-3",
    "lr_scheduler_type": "constant",
    "max_grad_norm": "0",
    "num_train_epochs": "2",
    "per_device_train_batch_size": "16",
    "per_device_eval_batch_size": "50",
    "logging_steps": "25",
    "save_strategy": "no",
    "seed": "0",
}

USAGE = "prefixdpo train [config.yaml] [--model NAME_OR_PATH] [--dataset NAME_OR_PATH] [--output-dir DIR] [--OPTION VALUE ...]"


def register(subparsers) -> None:
    # No options declared here: `prefixdpo.cli` hands every argument after `train` to us unparsed
    # (`pass_through`), and `parse_train_args` knows the hundred-odd config options.
    p = subparsers.add_parser(
        "train", add_help=False, usage=USAGE,
        help="DPO-family training with prefix sharing (no arguments: the embedded demo)",
    )
    p.set_defaults(func=run, pass_through=True)


def _option_name(arg: str) -> str | None:
    return arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None


def _translate(argv: list[str]) -> list[str]:
    """The short spellings this command adds: --model, --dataset (exact names only)."""
    aliases = {"model": "--model_name_or_path", "dataset": "--dataset_name"}
    out = []
    for arg in argv:
        name = _option_name(arg)
        if name in aliases:
            value = arg.split("=", 1)[1:] if "=" in arg else []
            out.append(aliases[name] + ("=" + value[0] if value else ""))
        else:
            out.append(arg)
    return out


def _explicit_options(argv: list[str]) -> set[str]:
    """Option names set by the YAML file (argv[0]) or on the command line."""
    names = {n for n in map(_option_name, argv) if n}
    if argv and argv[0].endswith((".yaml", ".yml")) and os.path.isfile(argv[0]):
        import yaml

        with open(argv[0], encoding="utf-8") as fh:
            values = yaml.safe_load(fh) or {}
        if isinstance(values, dict):
            names |= {str(k).replace("-", "_") for k in values}
    return names


def _with_demo_defaults(argv: list[str]) -> list[str]:
    explicit = _explicit_options(argv)
    extra = [a for k, v in DEMO_DEFAULTS.items() if k not in explicit for a in (f"--{k}", v)]
    if argv and not argv[0].startswith("-"):
        return argv[:1] + extra + argv[1:]  # the YAML file must stay first
    return extra + argv


def _print_help() -> None:
    from transformers import HfArgumentParser

    from prefixdpo.config import DataArguments, ModelArguments, PrefixDPOConfig

    print(f"usage: {USAGE}\n\n{__doc__}")
    print("--model / --dataset are short for --model_name_or_path / --dataset_name. All options:\n")
    HfArgumentParser((PrefixDPOConfig, ModelArguments, DataArguments)).print_help()


def _load_model(model_args, config):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = model_args.model_name_or_path
    kwargs = {"trust_remote_code": config.trust_remote_code}  # off unless --trust-remote-code
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype, None)
    if dtype is None:
        raise ValueError(f"dtype={model_args.dtype!r}: expected auto, float32, bfloat16 or float16")
    if config.bf16 and model_args.dtype == "auto":
        dtype = torch.bfloat16
    if model_args.load_in_4bit:
        if not torch.cuda.is_available():
            raise ValueError("load_in_4bit (QLoRA) needs CUDA and bitsandbytes")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=config.trust_remote_code)
    # transformers loads safetensors when present and .bin files only with torch.load(weights_only=True).
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    return model, tokenizer


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def run(args) -> int:
    argv = list(getattr(args, "extra_argv", []))
    if any(a in ("-h", "--help") for a in argv):
        _print_help()
        return 0
    from prefixdpo.config import data_options, parse_train_args

    argv = _translate(argv)
    config, model_args, data_args = parse_train_args(argv)
    demo_model = model_args.model_name_or_path is None
    demo_data = data_args.dataset_name is None
    if demo_model and demo_data:
        config, model_args, data_args = parse_train_args(_with_demo_defaults(argv))

    from prefixdpo.data.prepare import prepare_examples
    from prefixdpo.trainer import PrefixDPOTrainer

    start = time.time()
    demo = None
    if demo_model or demo_data:
        from prefixdpo.demo import build_demo

        demo = build_demo(os.path.join(config.output_dir, "demo-base"))
        print(f"Embedded default built in {demo.model_dir.parent} "
              f"({'model' if demo_model else ''}{' and ' if demo_model and demo_data else ''}{'data' if demo_data else ''}).")
    if demo_model:
        model_args.model_name_or_path = str(demo.model_dir)
    model, tokenizer = _load_model(model_args, config)

    options = data_options(config, data_args)
    if demo_data:
        options.split, options.eval_split = "train", "test"
        source = {"train": str(demo.train_file), "test": str(demo.eval_file)}
    else:
        source = data_args.dataset_name
    prepared = prepare_examples(source, tokenizer, options)
    print(f"Train data: {prepared.report.summary()}")
    if prepared.eval_report is not None:
        print(f"Held-out data: {prepared.eval_report.summary()}")
    if not prepared.examples:
        raise ValueError(f"no usable training examples ({prepared.report.summary()})")

    params = sum(p.numel() for p in model.parameters())
    print(f"Model: {model_args.model_name_or_path} ({type(model).__name__}, {params / 1e6:.2f}M parameters); "
          f"{len(prepared.examples)} training pairs; output: {config.output_dir}", flush=True)
    trainer = PrefixDPOTrainer(
        model=model,
        ref_model=model_args.ref_model_name_or_path,
        args=config,
        train_dataset=prepared.examples,
        eval_dataset=prepared.eval_examples or None,
        processing_class=tokenizer,
        peft_config=model_args.peft_config(),
    )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)

    print()
    if prepared.eval_examples:
        metrics = trainer.evaluate()
        accuracy = metrics.get("eval_rewards/accuracies")
        print(f"Held-out reward accuracy (eval_rewards/accuracies): {_fmt(accuracy)} "
              f"on {len(prepared.eval_examples)} pairs; eval_loss {_fmt(metrics.get('eval_loss'))}")
    else:
        logged = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
        last = logged[-1]["rewards/accuracies"] if logged else None
        print(f"No held-out split (pass --dataset_test_split NAME); last training reward accuracy: {_fmt(last)}")
    print(f"Model saved to {os.path.abspath(config.output_dir)} ({time.time() - start:.0f} s)")
    sys.stdout.flush()
    return 0
