"""`prefixdpo.core.models`: the one place models and tokenizers are loaded."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from prefixdpo.errors import ConfigError
from prefixdpo.core.models import load_causal_lm, load_tokenizer, resolve_dtype


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(path)
    return path, model


def test_loads_the_saved_weights_in_the_asked_dtype(saved):
    path, original = saved
    model = load_causal_lm(path)
    assert model.dtype == torch.float32  # "auto": the checkpoint's dtype
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))
    assert load_causal_lm(path, bf16=True).dtype == torch.bfloat16
    assert load_causal_lm(str(path), dtype="float16", bf16=True).dtype == torch.float16  # an explicit dtype wins
    assert load_causal_lm(path, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert load_causal_lm(path, attn_implementation="eager").config._attn_implementation == "eager"


def test_load_tokenizer(saved):
    path, _ = saved
    tokenizer = load_tokenizer(path)
    text = "hello world"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_models_from_one_config_do_not_share_it(saved):
    _, original = saved
    config = original.config
    a = load_causal_lm(config, dtype="float32", attn_implementation="eager")
    b = load_causal_lm(config, dtype="float32", attn_implementation="sdpa")
    assert a.config is not config and b.config is not a.config
    assert (a.config._attn_implementation, b.config._attn_implementation) == ("eager", "sdpa")
    assert config._attn_implementation == original.config._attn_implementation


def test_bad_requests_are_config_errors(saved):
    path, _ = saved
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        resolve_dtype("fp8")
    from transformers import BitsAndBytesConfig

    quantized = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="^quantization_config needs a CUDA device"):
            load_causal_lm(path, model_init_kwargs=quantized)
    with pytest.raises(ConfigError, match="not to a config"):
        load_causal_lm(saved[1].config, model_init_kwargs=quantized)
