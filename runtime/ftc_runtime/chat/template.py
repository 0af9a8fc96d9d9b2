"""`ChatTemplate`: a conversation (OpenAI-style messages, optional tool schemas) rendered to the
prompt text the model was trained on, with the engine's Jinja chat template.

Checkpoint templates are written for Hugging Face's renderer, so this one behaves as it does: a
sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` that keeps
non-ASCII text and takes indent/separators/sort_keys, and the globals `raise_exception` and
`strftime_now`. A template that raises gets a `ChatTemplateError` naming the file.

`render_ids` encodes the prompt so that only the template's own special tokens are control tokens:
special-token text in a client's strings (content, tool names, arguments, ...) stays text, so no
message can close its turn and forge a system, assistant or tool turn.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from ftc_runtime.chat.tokenizer import Tokenizer

# Placeholders for special-token text in the shadow render: private-use characters, which no special
# token of a real vocabulary holds and json.dumps(ensure_ascii=False) (`tojson`) writes unescaped.
_PRIVATE_USE = re.compile("[\ue000-\uf8ff\U000f0000-\U000ffffd]")
_PRIVATE_USE_RANGES = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


# The variables `render` sets itself; options (a request's chat_template_kwargs) cannot replace them.
TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt"})


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
        except UnicodeDecodeError as e:
            raise ChatTemplateError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **options: Any) -> str:
        """The prompt for `messages`; `options` reach the template as variables (for example
        `enable_thinking=False`)."""
        try:
            return self._template.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt, **options)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: {e.message or e}") from None

    def render_ids(self, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                   **options: Any) -> list[int]:
        """The prompt's token ids, with control tokens only where the template writes them: special-token
        text in any string of `messages`, `tools` or `options` (values and keys) is encoded as text.
        A string that is not valid Unicode (a lone surrogate) raises a ChatTemplateError naming it.

        Without special-token text in those strings the ids are `tokenizer.encode(render(...))`. With
        it, the template renders again with that text masked by placeholders of the same length (the
        shadow), which still lines up with the prompt character for character: a special token of the
        prompt is the template's own when the shadow has it at the same place. A template that reshapes
        text by special-token strings breaks that match; then every special token that a client string
        holds is text throughout the prompt."""
        inputs = {"messages": messages, "tools": tools, "options": options}
        strings = _client_strings(inputs, "", [])
        text = self.render(messages, tools, add_generation_prompt, **options)
        _check_text(text, f"{self.name}: rendered prompt")
        placeholder = _placeholder([*strings, *tokenizer.special_tokens, self.source])
        masker = _Masker(tokenizer.special_tokens, placeholder)
        masked = masker.map(inputs)
        if not masker.hit:
            return tokenizer.encode(text)
        try:
            shadow = self.render(masked["messages"], masked["tools"], add_generation_prompt, **masked["options"])
        except ChatTemplateError:  # the template reacted to the masked text: the renders cannot be lined up
            shadow = None
        ids, spans = tokenizer.encode_with_offsets(text)
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        found = [k for k, t in enumerate(ids) if t in names]
        own = _own_tokens(text, shadow, placeholder, found, spans)
        if own is None:
            # The template reshapes text by special-token strings (e.g. splits content on a special
            # '</think>'): no place-by-place match. Safe rule: every special token that a client string
            # holds, whole or at its edge, is text wherever it occurs; the others remain control tokens.
            own = [k for k in found if names[ids[k]] not in masker.hit]
        if len(own) == len(found):
            return ids
        return _encode_pieces(tokenizer, text, ids, spans, found, set(own))


def _check_text(text: str, where: str) -> None:
    """Lone surrogates (JSON can carry "\\ud800") are not text: refused here, naming the place,
    rather than failing deep in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatTemplateError(f"{where}: invalid text (lone surrogate U+{ord(text[e.start]):04X} "
                                f"at character {e.start})") from None


def _child(path: str, key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _client_strings(value: Any, path: str, out: list[str]) -> list[str]:
    """Appends every string of `value` (dict keys included) to `out`, each checked to be valid text;
    the path in an error reads as `messages[2].content`."""
    if isinstance(value, str):
        _check_text(value, path)
        out.append(value)
    elif isinstance(value, dict):
        for key, sub in value.items():
            if isinstance(key, str):
                _check_text(key, f"{path}: key {key!r}")
                out.append(key)
            _client_strings(sub, _child(path, key), out)
    elif isinstance(value, (list, tuple)):
        for i, sub in enumerate(value):
            _client_strings(sub, f"{path}[{i}]", out)
    return out


def _placeholder(taken: list[str]) -> str:
    """A private-use character that none of `taken` holds."""
    used = set()
    for s in taken:
        used.update(_PRIVATE_USE.findall(s))
    for codes in _PRIVATE_USE_RANGES:
        for code in codes:
            if chr(code) not in used:
                return chr(code)
    raise ChatTemplateError("messages: the text holds every private-use character; none is left to mask "
                            "special-token text with")


class _Masker:
    """Copies of client strings with special-token text masked: each special token that a string holds,
    and the part of one that it begins or ends with (whitespace aside), which the template could
    complete (`<function={{ name }}>` with the name `<|im_end|`). `hit`: the special tokens involved."""

    def __init__(self, specials: Iterable[str], placeholder: str):
        tokens = sorted(specials, key=len, reverse=True)  # longest first, as the tokenizer matches
        self._whole = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self._heads: dict[str, set[str]] = {}
        self._tails: dict[str, set[str]] = {}
        for token in tokens:
            for k in range(1, len(token)):
                self._heads.setdefault(token[:k], set()).add(token)
                self._tails.setdefault(token[k:], set()).add(token)
        self._longest = max(map(len, tokens), default=1) - 1
        self._placeholder = placeholder
        self.hit: set[str] = set()

    def map(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._mask(value)
        if isinstance(value, dict):
            return {self.map(k): self.map(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.map(v) for v in value]
        return value

    def _mask(self, s: str) -> str:
        if self._whole is not None:
            s = self._whole.sub(self._cover, s)
        stop = len(s.rstrip())
        k = self._edge(s, stop, self._heads, at_end=True)
        if k:
            s = s[:stop - k] + self._placeholder * k + s[stop:]
        start = len(s) - len(s.lstrip())
        k = self._edge(s, start, self._tails, at_end=False)
        return s[:start] + self._placeholder * k + s[start + k:] if k else s

    def _cover(self, match: re.Match) -> str:
        self.hit.add(match.group())
        return self._placeholder * len(match.group())

    def _edge(self, s: str, at: int, parts: dict[str, set[str]], at_end: bool) -> int:
        """The length of the longest part of a special token that `s` ends (else begins) with at `at`."""
        for k in range(min(self._longest, at if at_end else len(s) - at), 0, -1):
            part = s[at - k:at] if at_end else s[at:at + k]
            if part in parts:
                self.hit |= parts[part]
                return k
        return 0


def _own_tokens(text: str, shadow: str | None, placeholder: str, found: list[int],
                spans: list[tuple[int, int]]) -> list[int] | None:
    """Which special tokens of the prompt (`found`: indices into its ids) the template wrote: those the
    shadow has at the same place. None when the shadow is not the prompt with only placeholders put in
    (the template changed or moved text by the masked text: a `dictsort` of keys can line a client's
    token up with a template's own one), so that places prove nothing."""
    if shadow is None or len(shadow) != len(text):
        return None
    for piece in re.finditer(f"[^{placeholder}]+", shadow):
        if not text.startswith(piece.group(), piece.start()):
            return None
    return [k for k in found if shadow[spans[k][0]:spans[k][1]] == text[spans[k][0]:spans[k][1]]]


def _encode_pieces(tokenizer: Tokenizer, text: str, ids: list[int], spans: list[tuple[int, int]], found: list[int],
                   own: set[int]) -> list[int]:
    """`ids` with every stretch between two of the template's special tokens that holds a client's
    special token encoded again, special-token strings as text; other stretches keep their ids."""
    out: list[int] = []
    start, char, dirty = 0, 0, False  # where the current stretch begins: token index, character
    for k in found:
        if k not in own:
            dirty = True
            continue
        out += tokenizer.encode_text(text[char:spans[k][0]]) if dirty else ids[start:k]
        out.append(ids[k])
        start, char, dirty = k + 1, spans[k][1], False
    out += tokenizer.encode_text(text[char:]) if dirty else ids[start:]
    return out
