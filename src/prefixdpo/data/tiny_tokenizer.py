"""A tiny byte-level BPE tokenizer, trained locally in well under a second, for tests and demos.

Never downloads anything. It behaves like the tokenizers real models ship (Llama-3 / GPT-2 style):
byte-level BPE (any Unicode text round-trips), a BOS token added by `tokenizer(text)` but not by
`apply_chat_template` (the template writes it), an EOS token, a pad token, and a ChatML-like chat template
whose turns end with `<|im_end|>` followed by a newline - so the usual boundary problems (BPE merges across
the prompt/response boundary, template tokens between turns, BOS/EOS) all show up with it.
"""

from __future__ import annotations

from collections.abc import Iterable

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# ChatML-like: `{bos}<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n...<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog. ",
    "Question: what is the capital of France? Answer: Paris is the capital of France. ",
    "Human: how do I bake bread? Assistant: Mix flour, water, salt and yeast, then bake it. ",
    "hello world, hello there, helpful answers help everyone. 0123456789 +-*/=()[]{}<>:;,.!?'\" ",
)


def build_tiny_tokenizer(
    texts: Iterable[str] | None = None,
    vocab_size: int = 384,
    chat_template: bool = True,
    add_bos: bool = True,
    use_regex: bool = True,
):
    """Train a byte-level BPE on `texts` and wrap it as a `transformers.PreTrainedTokenizerFast`.

    texts:      training corpus (a few sentences are enough); defaults to a small built-in one.
    vocab_size: total size including the 256 byte symbols and the 5 special tokens.
    chat_template: set the ChatML-like `CHAT_TEMPLATE` (conversational records need one).
    add_bos:    `tokenizer(text)` prepends BOS (as Llama-3 does); False = no special tokens (as GPT-2).
    use_regex:  GPT-2 pre-tokenisation regex. False lets merges cross word and space boundaries, the
                harshest case for splitting `prompt + response` into two token lists.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) if texts is not None else list(_DEFAULT_TEXTS)
    specials = [BOS, EOS, PAD, IM_START, IM_END]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens, ever
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    if chat_template:
        hf.chat_template = CHAT_TEMPLATE
    return hf
