"""`prefixdpo verify` on models whose stock attention is not SDPA (Gemma-2: attention soft-capping, eager
only in transformers): the stock comparison passes use the model's own eager attention, and on CPU the
prefix-shared side is refused in one line naming soft-capping (no CPU backend reproduces it)."""

import pytest
import torch

from conftest import random_examples, tiny_model
from prefixdpo.cli import main
from prefixdpo.core.verify import separate_pass_logps, stock_implementation

GEMMA2 = dict(num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def saved_gemma2(tmp_path_factory):
    from prefixdpo.commands.verify import DEFAULT_PROMPTS, DEFAULT_RESPONSES
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("gemma2")
    tokenizer = build_tiny_tokenizer(DEFAULT_PROMPTS + DEFAULT_RESPONSES)
    tokenizer.save_pretrained(path)
    tiny_model("gemma2", vocab_size=len(tokenizer), **GEMMA2).save_pretrained(path)
    return str(path)


def test_stock_pass_uses_an_implementation_the_model_supports():
    gemma2 = tiny_model("gemma2", **GEMMA2)
    assert gemma2.config.attn_logit_softcapping is not None
    assert stock_implementation(gemma2) == "eager"
    assert stock_implementation(tiny_model("llama")) == "sdpa"
    examples = random_examples()
    logps = separate_pass_logps(gemma2, examples)  # raised "does not support ... sdpa" before
    assert logps.shape == (sum(ex.num_responses for ex in examples),) and torch.isfinite(logps).all()
    assert gemma2.config._attn_implementation == "eager"  # restored


def test_gemma2_soft_capping_is_refused_in_one_line_on_cpu(saved_gemma2, capsys):
    """sdpa has no soft-capping; flex reproduces it, but only on CUDA (on CPU it is refused for every model:
    tests/test_verify_backends.py)."""
    assert main(["verify", "--model", saved_gemma2, "--attention", "sdpa"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not progress bars
    assert len(err) == 1 and "soft-capping" in err[0] and "Gemma2ForCausalLM" in err[0]
    assert "--device cuda --attention flex" in err[0]
