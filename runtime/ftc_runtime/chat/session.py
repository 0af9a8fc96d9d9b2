"""A conversation with an engine, turn by turn, as `ftc run` holds it: the chat template renders
the history, the answer streams as ("reasoning", text) and ("content", text) parts with no control
token in them (`Engine.hidden_token_ids`), and then joins the history."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ftc_runtime.chat.stop_strings import StopMatcher
from ftc_runtime.chat.tokenizer import StreamDecoder
from ftc_runtime.chat.tool_parsers import ReasoningSplitter, prompt_opens_reasoning
from ftc_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from ftc_runtime.engine import Engine, Generation


class ChatSession:
    def __init__(self, engine: Engine, system: str | None = None, stop_at_eos: bool = True, stop: list[str] = ()):
        if engine.chat_template is None:
            raise ValueError(f"{engine.manifest.root}: the engine has no chat template (compile it again, or "
                             "give --raw for a plain completion)")
        self.engine = engine
        self.system, self.stop_at_eos = system, stop_at_eos
        self.stop = list(stop)  # an answer ends before the first of these strings
        self.messages: list[dict[str, str]] = []
        self.generation: Generation | None = None  # the last turn's: its stats (prompt tokens, timings)
        self.tokens: list[int] = []  # the last turn's answer, control tokens included
        self.reset()

    def reset(self) -> None:
        """Forgets the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str, max_new_tokens: int, sampling: SamplingParams | None = None
              ) -> Iterator[tuple[str, str]]:
        """The answer to the user's `text`, in parts as it streams, ending before the first stop
        string. Leaving the iteration early (an interrupted turn) keeps what was said so far in the
        history."""
        self.messages.append({"role": "user", "content": text})
        tokenizer = self.engine.tokenizer
        ids = self.engine.chat_template.render_ids(tokenizer, self.messages)
        self.generation = self.engine.generate(ids, max_new_tokens, sampling, self.stop_at_eos)
        self.tokens = []
        hidden = self.engine.hidden_token_ids
        decoder, stops, content = StreamDecoder(tokenizer), StopMatcher(self.stop), []
        splitter = ReasoningSplitter(opened=prompt_opens_reasoning(tokenizer, ids))
        try:
            for token in self.generation:
                self.tokens.append(token)
                if token not in hidden:
                    yield from self._kept(splitter.feed(stops.feed(decoder.push(token))), content)
                if stops.hit is not None:
                    break
            else:
                yield from self._kept(splitter.feed(stops.feed(decoder.flush()) + stops.flush()), content)
            yield from self._kept(splitter.flush(), content)
        finally:
            self.messages.append({"role": "assistant", "content": "".join(content)})

    @staticmethod
    def _kept(parts: list[tuple[str, str]], content: list[str]) -> Iterator[tuple[str, str]]:
        for kind, piece in parts:
            if kind == "content":
                content.append(piece)
            yield kind, piece
