"""A byte-level tokenizer for engines of random weights (a checkpoint must bring its own: checkpoint_tokenizer.py).

The spec's special tokens sit at their ids, the 256 bytes at the lowest ids left (0-255 unless a
special token takes one: DeepSeek's begin and end of sentence are ids 0 and 1), and every other id
of the vocabulary decodes to a visible `<|reserved_N|>`, so any id the model emits can be shown.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ftc_runtime.spec import ModelSpec, SpecError

BYTE_TOKENS = 256


def build_byte_tokenizer(spec: ModelSpec, path: Path) -> None:
    by_id = {tid: text for text, tid in spec.tokens.special.items()}
    if spec.vocab_size < BYTE_TOKENS + len(by_id):
        raise SpecError(f"spec field 'vocab_size' = {spec.vocab_size}: a checkpoint-free engine needs at "
                        f"least {BYTE_TOKENS + len(by_id)} (the {BYTE_TOKENS} bytes of its byte-level tokenizer and "
                        f"{len(by_id)} special tokens)")
    free = (tid for tid in range(spec.vocab_size) if tid not in by_id)
    byte_ids = [next(free) for _ in range(BYTE_TOKENS)]
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab, taken = dict(zip(byte_chars, byte_ids, strict=True)), set(byte_ids)
    for tid in range(spec.vocab_size):
        if tid not in taken:
            vocab[by_id.get(tid, f"<|reserved_{tid}|>")] = tid
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.tokens.special])
    tok.save(str(path))


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's bytes→unicode map: printable bytes map to themselves, others to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
