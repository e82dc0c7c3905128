"""The reward model made ready to train, as TRL 1.16's `RewardTrainer` prepares it: loaded as an
`AutoModelForSequenceClassification` with one label (a causal-LM checkpoint gets a new score head),
pad and EOS tokens agreed between tokenizer and config, LoRA for sequence classification (the score
head trains fully), dropout off, and prefixdpo's attention switched on."""

from __future__ import annotations

import contextlib

from prefixdpo.errors import ConfigError, UserError
from prefixdpo.core.model_checks import text_config
from prefixdpo.training.model_setup import prepare_policy
from prefixdpo.core.models import check_quantization_available, init_kwargs_dtype, resolve_dtype


@contextlib.contextmanager
def _quiet_head_swap():
    """Loading a causal LM as a sequence classifier: `score.weight` is new and `lm_head.*` unused, both on
    purpose; transformers would warn about each (TRL silences the same two keys)."""
    from transformers.modeling_layers import GenericForSequenceClassification as Generic

    saved = {k: getattr(Generic, k, None) for k in ("_keys_to_ignore_on_load_missing",
                                                    "_keys_to_ignore_on_load_unexpected")}
    Generic._keys_to_ignore_on_load_missing = [*(saved["_keys_to_ignore_on_load_missing"] or []), r"^score\.weight$"]
    Generic._keys_to_ignore_on_load_unexpected = [*(saved["_keys_to_ignore_on_load_unexpected"] or []), r"^lm_head\."]
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(Generic, key, value)


def load_reward_model(name_or_path, *, dtype="float32", trust_remote_code: bool = False,
                      model_init_kwargs: dict | None = None, seed: int | None = None):
    """`AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)`; `model_init_kwargs` win
    (their dtype read as TRL reads it; a quantization_config refused in one line where this machine cannot load
    it). `seed`: seeds torch first, so the new score head is reproducible (TRL calls `set_seed(args.seed)` before
    loading for the same reason)."""
    from transformers import AutoModelForSequenceClassification

    if (model_init_kwargs or {}).get("quantization_config") is not None:
        check_quantization_available()

    kwargs = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code,
              **(model_init_kwargs or {}), "num_labels": 1}
    if "dtype" in (model_init_kwargs or {}):
        kwargs["dtype"] = init_kwargs_dtype(model_init_kwargs["dtype"])
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    with _quiet_head_swap():
        try:
            return AutoModelForSequenceClassification.from_pretrained(str(name_or_path), **kwargs)
        except ValueError as err:  # transformers' words for an architecture with no such class (LFM2, gpt-oss...)
            if not str(err).startswith("Unrecognized configuration class"):
                raise
            kind = str(err).split("<class '")[1].split("'")[0].rsplit(".", 1)[-1] if "<class '" in str(err) else "its"
            raise ConfigError(f"{name_or_path}: transformers has no sequence-classification model for {kind} "
                              "(AutoModelForSequenceClassification, which TRL's RewardTrainer loads too); a reward "
                              "model needs one") from None


def _tokens_in_vocab(tokenizer, **tokens) -> None:
    vocab = tokenizer.get_vocab()
    for option, token in tokens.items():
        if token is not None and token not in vocab:
            raise ConfigError(f"{option}={token!r} is not a token of the tokenizer ({type(tokenizer).__name__})")


def agree_special_tokens(model, tokenizer, args) -> None:
    """TRL's rule: `eos_token` (if set) and the pad token (`pad_token`, else the tokenizer's, else its EOS)
    become the tokenizer's, and the model config's pad_token_id marks where each sequence's score is read.
    Without a tokenizer (Examples already tokenized) the model's config is left as it is."""
    if tokenizer is None:  # Examples given as token ids: the model's own pad_token_id stays (as the stock model)
        if args.pad_token or args.eos_token or args.chat_template_path:
            raise UserError("pad_token, eos_token and chat_template_path need processing_class (a tokenizer)")
        return
    cfg = text_config(model)
    _tokens_in_vocab(tokenizer, eos_token=args.eos_token)
    if args.eos_token is not None:
        tokenizer.eos_token = args.eos_token
        cfg.eos_token_id = tokenizer.eos_token_id
    pad = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an EOS token: set pad_token")
    _tokens_in_vocab(tokenizer, pad_token=pad)
    tokenizer.pad_token = pad
    cfg.pad_token_id = tokenizer.pad_token_id
    if args.chat_template_path is not None:
        if not str(args.chat_template_path).endswith((".jinja", ".j2")):
            raise ConfigError(f"chat_template_path={args.chat_template_path!r}: prefixdpo reads a .jinja/.j2 file "
                              "(cloning a model's template adds tokens, which TRL does and prefixdpo does not)")
        with open(args.chat_template_path, encoding="utf-8") as fh:
            tokenizer.chat_template = fh.read()


def prepare_reward_model(model, args, *, backend: str, peft_config=None, tokenizer=None):
    """(model, tokenizer, the pass backend of the run: `model_setup.prepare_policy`) ready to train; `model` may be a
    name/path (its tokenizer is loaded too)."""
    if isinstance(model, str):
        from prefixdpo.core.models import load_tokenizer

        init = args.model_init_kwargs or {}
        tokenizer = tokenizer or load_tokenizer(model, trust_remote_code=args.trust_remote_code,
                                                revision=init.get("revision"))
        model = load_reward_model(model, trust_remote_code=args.trust_remote_code, model_init_kwargs=init,
                                  seed=args.seed)
    if model is None:
        raise UserError("PrefixRewardTrainer needs a model (a sequence-classification model or a name/path)")
    if getattr(model.config, "num_labels", None) != 1:
        raise UserError(f"the model has num_labels={getattr(model.config, 'num_labels', None)}; a reward model "
                        "outputs one score: load it with num_labels=1 (or pass its name to have it loaded so)")
    agree_special_tokens(model, tokenizer, args)
    # from here on as the DPO policy: PEFT (task SEQ_CLS trains `score` fully), dropout off, our attention
    return prepare_policy(model, args, backend=backend, peft_config=peft_config, tokenizer=tokenizer)

