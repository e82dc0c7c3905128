"""Loading models and tokenizers: the one place that calls `from_pretrained` / `from_config`.

Safe by default: no remote code unless `trust_remote_code=True`; transformers reads safetensors when
present and `.bin` files only with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from prefixdpo.errors import ConfigError, UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None = "auto", bf16: bool = False) -> str | torch.dtype | None:
    """`"auto"` (the checkpoint's dtype; bfloat16 when `bf16`), a name in `DTYPES`, a `torch.dtype`, or None
    (transformers' default, as TRL's `ModelConfig(dtype=None)` passes it)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16 else "auto"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def init_kwargs_dtype(value) -> str | torch.dtype | None:
    """`model_init_kwargs["dtype"]` by TRL 1.16's rule: a `torch.dtype`, "auto" or None as given; "float32" /
    "bfloat16" / "float16" as the torch dtype; anything else is a `ConfigError`."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ConfigError(f"model_init_kwargs dtype={value!r}: expected auto, {', '.join(DTYPES)} or a torch.dtype")


def check_quantization_available(option: str = "quantization_config") -> None:
    """A `ConfigError` naming why this machine cannot load a bitsandbytes-quantized model (4/8-bit weights need a
    CUDA device and the bitsandbytes package); nothing where it can."""
    if not torch.cuda.is_available():
        raise ConfigError(f"{option} needs a CUDA device (bitsandbytes quantizes on the GPU); this machine has none")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{option} needs bitsandbytes, which is not installed (pip install bitsandbytes)")


def load_causal_lm(
    name_or_path,
    *,
    dtype: str | torch.dtype | None = "auto",
    bf16: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    model_init_kwargs: dict | None = None,
):
    """An `AutoModelForCausalLM` from a hub name or local path, or randomly initialised from a config.

    name_or_path: str / PathLike, or a `PretrainedConfig` (random init; deep-copied, because
        `from_config` stores the config in the model and writes the attention implementation into it,
        so two models built from one config object would share and overwrite each other's settings).
    dtype: "auto" (the checkpoint's own dtype), "float32" / "bfloat16" / "float16", a `torch.dtype`, or None
        (transformers' default).
    bf16: with dtype "auto", load in bfloat16 (what `--bf16` training computes in).
    attn_implementation: passed to transformers (None = its default; prefixdpo's own attention is set
        later by `prefixdpo.core.model_checks.prepare_model`).
    model_init_kwargs: more keyword arguments for `from_pretrained` (a checkpoint only): TRL's
        `DPOConfig.model_init_kwargs`, or what `ModelArguments.from_pretrained_kwargs` makes of the model options
        (revision, quantization_config, device_map, ...). They win over the arguments above, with `dtype`
        strings read as TRL reads them (`init_kwargs_dtype`); a `quantization_config` is refused in one line
        where this machine cannot load it (`check_quantization_available`).
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    kwargs = {"dtype": resolve_dtype(dtype, bf16), "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    from_config = isinstance(name_or_path, PretrainedConfig)
    extra = dict(model_init_kwargs or {})
    if extra:
        if from_config:
            raise ConfigError("model_init_kwargs apply to loading a checkpoint, not to a config to initialise from")
        if "dtype" in extra:
            extra["dtype"] = init_kwargs_dtype(extra["dtype"])
        if extra.get("quantization_config") is not None:
            check_quantization_available()
    if from_config:
        return AutoModelForCausalLM.from_config(copy.deepcopy(name_or_path), **kwargs)
    check_local_path(name_or_path)
    return AutoModelForCausalLM.from_pretrained(str(name_or_path), **{**kwargs, **extra})


_LOCAL_HINTS = ("/", "./", "../", "~")


def check_local_path(name_or_path) -> None:
    """A name written as a path (`./m`, `/m`, `~/m`, `../m`) that does not exist is a `UserError` saying so,
    not a hub look-up that fails with transformers' message about repository ids."""
    name = str(name_or_path)
    if name.startswith(_LOCAL_HINTS) and not Path(name).expanduser().exists():
        raise UserError(f"no such model folder: {name}")


# Files that hold a tokenizer's vocabulary (fast, SentencePiece, BPE, WordPiece, tiktoken): a folder with none
# of them has no tokenizer, whatever its tokenizer_config.json says.
_VOCABULARY_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "vocab.*")


def load_tokenizer(name_or_path, *, trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer saved with a model (hub name or local path); `revision` as the model's (TRL takes it from
    `model_init_kwargs`). A local folder it cannot be loaded from is a `UserError` naming the folder and what
    is missing (a model saved without `tokenizer.save_pretrained`)."""
    from transformers import AutoTokenizer

    check_local_path(name_or_path)
    kwargs = {"revision": revision} if revision is not None else {}
    try:
        return AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code, **kwargs)
    except (ValueError, OSError) as err:
        folder = Path(str(name_or_path)).expanduser()
        if not folder.is_dir():
            raise  # a hub name: transformers' own error says what failed (an OSError is one line at the CLI)
        problem = _tokenizer_problem(folder, err)
        raise UserError(f"{name_or_path}: no tokenizer can be loaded from this folder ({problem}); save the model's "
                        "tokenizer into it with tokenizer.save_pretrained") from None


def _tokenizer_problem(folder: Path, err: Exception) -> str:
    """What is wrong with a model folder's tokenizer, in a few words."""
    if not any(any(folder.glob(pattern)) for pattern in _VOCABULARY_FILES):
        has_config = (folder / "tokenizer_config.json").is_file()
        return ("tokenizer_config.json but " if has_config else "") + "no vocabulary file: none of tokenizer.json, " \
            "tokenizer.model, vocab.json + merges.txt, vocab.txt"
    return " ".join(str(err).split()) or type(err).__name__
