"""Arithmetic's step checkers (`gear.tasks.steps`, issue 67) and the character spans they give:
an empty character span marks no token."""

from __future__ import annotations

import torch

from gear.spans import char_span_mask


def word_tokenizer():
    """Whole words as tokens ("12", "+", ...), built in code: tokens of several characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "12", "+", "5", "=", "17", "18"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


def test_an_empty_span_marks_no_token_even_inside_one():
    tok = word_tokenizer()
    ids = torch.tensor([tok("12 + 5 = 18", add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    for start in range(12):  # inside "12", "18", at a boundary, at the end
        empty = char_span_mask(tok, ids, mask, lambda i, text, s=start: (s, s), "test")
        assert not bool(empty.any()), start
    one = char_span_mask(tok, ids, mask, lambda i, text: (10, 11), "test")
    assert one.tolist() == [[False, False, False, False, True]]  # "8" marks all of "18"
