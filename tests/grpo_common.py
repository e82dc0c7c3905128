"""Shared by the GRPO/RLOO tests: a tiny local tokenizer and models (no downloads), prompt-only data, rewards."""

from __future__ import annotations

import functools

import torch

from conftest import tiny_model

# Prompts with a long shared instruction (what prefix sharing saves) and a short question.
INSTRUCTION = "Human: answer the question in a few words, helpful answers help everyone. Question: "
QUESTIONS = ("what is the capital of France?", "how do I bake bread?", "hello there", "the quick brown fox")


@functools.cache
def tokenizer():
    from prefixdpo.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


ARCH_OVERRIDES = {
    "llama": {},
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=512, n_inner=64),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
}


def tiny_causal_lm(arch: str = "llama", **overrides):
    """A tiny fp32 model over the tiny tokenizer's vocabulary, with its special tokens set."""
    tok = tokenizer()
    kwargs = {**ARCH_OVERRIDES.get(arch, {}), **overrides}
    special = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = tiny_model(arch, vocab_size=len(tok), **special, **kwargs)
    model.generation_config.update(**special)
    return model


def saved_tiny_model(folder, arch: str = "llama", **overrides) -> str:
    """Save a tiny model to `folder` and return its path (TRL builds a reference model from the policy's path)."""
    tiny_causal_lm(arch, **overrides).save_pretrained(folder)
    return str(folder)


def prompt_dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [INSTRUCTION + QUESTIONS[i % len(QUESTIONS)] for i in range(n)]})


def reward_vowels(completions, **kwargs) -> list[float]:
    """A reward a tiny model can move: the share of vowels in the completion text."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def rows_with_groups(seed: int = 0, completion_width: int = 14):
    """TRL-shaped rows of three prompt groups, shuffled: (input_ids [N, L], attention_mask [N, L], K).

    Prompts of 9, 4 and 6 tokens, left-padded to 9; completions of very different lengths, some ending at EOS
    (masked after it), some cut at the width (no EOS), one fully masked (as mask_truncated_completions does).
    """
    tok = tokenizer()
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(5, len(tok), (n,), generator=g).tolist()

    prompts = [ids(9), ids(4), ids(6)]
    # (prompt index, completion length, ends with EOS, fully masked)
    specs = [(0, completion_width, False, False), (0, 3, True, False), (0, 1, True, False), (0, 9, True, False),
             (1, completion_width, False, False), (1, 6, True, False), (1, completion_width, False, True),
             (2, 11, True, False)]
    P, K = max(len(p) for p in prompts), completion_width
    rows, masks = [], []
    for p, n, eos, masked in specs:
        prompt = prompts[p]
        completion = ids(n - 1) + [tok.eos_token_id] if eos else ids(n)
        pad_left, pad_right = P - len(prompt), K - n
        rows.append([tok.pad_token_id] * pad_left + prompt + completion + [tok.pad_token_id] * pad_right)
        keep = 0 if masked else 1
        masks.append([0] * pad_left + [1] * len(prompt) + [keep] * n + [0] * pad_right)
    order = torch.randperm(len(rows), generator=g)
    return torch.tensor(rows)[order], torch.tensor(masks)[order], K
