"""Edits of nested fields (spec dicts, engine.json) for the tests that damage them."""

from __future__ import annotations

from typing import Any

DELETE = object()  # as a value: delete the field


def set_field(data: dict, keys: str | tuple[str, ...], value: Any) -> None:
    """Sets (or with DELETE deletes) the field at `keys`: dotted, or a tuple where a key has dots."""
    *parents, last = keys.split(".") if isinstance(keys, str) else keys
    for p in parents:
        data = data[p]
    if value is DELETE:
        del data[last]
    else:
        data[last] = value
