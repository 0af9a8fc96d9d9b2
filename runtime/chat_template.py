"""`ChatTemplate`: a conversation (OpenAI-style messages, optional tool schemas) rendered to the
prompt text the model was trained on, with the engine's Jinja chat template.

Checkpoint templates are written for Hugging Face's renderer, so this one behaves as it does: a
sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII text and takes indent/separators/sort_keys, and the globals `raise_exception` and
`strftime_now`. A template that raises gets a `ChatTemplateError` naming the file.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be read or rendered; the message names the file and the cause."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, name: str = "<chat template>"):
        self.source, self.name = source, name
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{name}: line {e.lineno}: {e.message}") from None

    @classmethod
    def load(cls, path: Path) -> ChatTemplate:
        try:
            return cls(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise ChatTemplateError(f"{path}: {e.strerror or e}") from None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **options: Any) -> str:
        """The prompt for `messages`; `options` reach the template as variables (for example
        `enable_thinking=False`)."""
        try:
            return self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **options)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: {e.message or e}") from None
