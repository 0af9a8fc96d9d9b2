"""The tokenizer.json every test checkpoint carries, as real checkpoints do (`ftc compile` refuses a
checkpoint without one): a byte-level BPE built with `tokenizers`, the 256 byte tokens and ChatML's
special tokens, ids 0-258. The tiny models' vocabularies are larger (320): the rows past the
tokenizer are padding, as Qwen3's 151936 rows are past its 151669 tokens."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_TOKENS = 256 + len(SPECIAL_TOKENS)  # a model's vocab_size must be at least this


def byte_tokenizer(extra_tokens: int = 0) -> Tokenizer:
    """The tokenizer; `extra_tokens` more ordinary tokens after the special ones (ids from 259 on),
    for tests of a tokenizer too large for its model."""
    extra = [f"<extra_{i}>" for i in range(extra_tokens)]
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + SPECIAL_TOKENS + extra
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save_tokenizer(directory: Path, extra_tokens: int = 0) -> Path:
    """Writes DIRECTORY/tokenizer.json; returns its path."""
    path = directory / "tokenizer.json"
    byte_tokenizer(extra_tokens).save(str(path))
    return path
