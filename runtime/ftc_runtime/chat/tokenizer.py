"""Text ↔ token ids with the engine's `tokenizer.json`, and streaming detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = HFTokenizer.from_file(str(path))
        # `encode_special_tokens` is a setting of the instance, and prompts are encoded on worker
        # threads: a second instance keeps it on for good instead of toggling shared state.
        self._as_text = HFTokenizer.from_file(str(path))
        self._as_text.encode_special_tokens = True
        # The added tokens marked special (<|im_start|>, <|im_end|>, ...): control tokens, which a
        # client's text must never produce. Non-special added tokens (Qwen3's <think>) are not here.
        self.special_tokens: dict[str, int] = {
            token.content: i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}

    def encode(self, text: str) -> list[int]:
        """`text` as the model reads a whole prompt: special-token strings become control tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """`text` with special-token strings encoded as ordinary text (non-special added tokens stay
        tokens, as `encode` makes them)."""
        return self._as_text.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s ids and each token's character span in `text` (a special token's span takes in
        the whitespace that its lstrip/rstrip absorbs)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class StreamDecoder:
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences. Each
    step decodes a short window of the latest ids (tokenizers' `DecodeStream`), not the whole
    answer again, so an answer of n tokens costs O(n), not O(n^2)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self.pending: list[int] = []  # ids whose text is still held back

    def push(self, token: int) -> str:
        self.pending.append(token)
        delta = self._stream.step(self.tokenizer._tok, token)
        if delta is None:
            return ""
        self.pending = []
        return delta

    def flush(self) -> str:
        """What is still held back once no token will follow (an unfinished UTF-8 sequence, shown
        as the replacement character, as a whole decode shows it)."""
        held, self.pending = self.pending, []
        return self.tokenizer.decode(held) if held else ""
