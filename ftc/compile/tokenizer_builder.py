"""A byte-level tokenizer for engines of random weights (a checkpoint must bring its own: checkpoint_tokenizer.py).

Ids 0-255 are the bytes, the spec's special tokens sit at their ids, and every other id of the
vocabulary decodes to a visible `<|reserved_N|>`, so any id the model emits can be shown.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ftc_runtime.spec import ModelSpec, SpecError

BYTE_TOKENS = 256


def build_byte_tokenizer(spec: ModelSpec, path: Path) -> None:
    if spec.vocab_size < BYTE_TOKENS:
        raise SpecError(f"spec field 'vocab_size' = {spec.vocab_size}: a checkpoint-free engine needs at "
                        f"least {BYTE_TOKENS} (its byte-level tokenizer)")
    for text, tid in spec.tokens.special.items():
        if tid < BYTE_TOKENS:
            raise SpecError(f"spec field 'tokens.special.{text}' = {tid}: ids below {BYTE_TOKENS} are the "
                            "byte tokens of the generated tokenizer")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    by_id = {tid: text for text, tid in spec.tokens.special.items()}
    for tid in range(BYTE_TOKENS, spec.vocab_size):
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
