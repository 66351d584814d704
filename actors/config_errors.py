"""A config validation error (msgspec's) as one line that names the dotted key,
what was given there and, for an unknown key or choice, what is expected."""

from __future__ import annotations

import re
import typing

import msgspec

__all__ = ["friendly"]

_MSG = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def friendly(err: msgspec.ValidationError, root: type, tree: dict[str, object] | None = None) -> str:
    """``err``, met decoding ``tree`` as ``root``, as one line naming the dotted key and what is wrong."""
    m = _MSG.match(str(err))
    what, path = m.group("what"), (m.group("path") or "").lstrip(".")
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key{_known_keys(root, path)}"
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        key = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{key}: required key is missing"
    if what.startswith("Invalid enum value"):
        allowed = _choices(_field_type(root, path))
        if allowed:
            what += f" (expected one of: {', '.join(allowed)})"
    # a section's own check (``__post_init__``) names its field first: "ports must be ..."
    own = re.match(r"(\w+) (must .*)", what, re.S)
    node = _field_type(root, path)
    if own and isinstance(node, type) and issubclass(node, msgspec.Struct) and \
            own.group(1) in {f.name for f in msgspec.structs.fields(node)}:
        return f"{path}.{own.group(1)}: {own.group(2)}" if path else f"{own.group(1)}: {own.group(2)}"
    what = re.sub(r"`([^`]*)`", r"\1", what)
    what = what[0].lower() + what[1:] if what else what
    given = _given(tree, path)
    if given is not _ABSENT:
        what += f" ({given!r})" if ", got " in what else f", got {given!r}"
    return f"{path or '<root>'}: {what}"


_ABSENT = object()


def _given(tree: object, path: str) -> object:
    """The scalar the config gave at ``path`` (dotted), or ``_ABSENT``."""
    node = tree
    for part in path.split(".") if path and tree is not None else ():
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
    return _ABSENT if node is tree or isinstance(node, (dict, list)) else node


def _choices(tp: object) -> list[str]:
    """The values a Literal field takes, ``null`` for an optional one (``Literal[...] | None``)."""
    if typing.get_origin(tp) is typing.Literal:
        return [str(a) for a in typing.get_args(tp)]
    return [c for a in typing.get_args(tp) for c in (["null"] if a is type(None) else _choices(a))]


def _field_type(root: type, path: str) -> object:
    node: object = root
    for part in [p for p in path.split(".") if p]:
        if part.isdigit() and typing.get_origin(node) in (list, tuple):  # an item of a list field
            node = typing.get_args(node)[0]
            continue
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return None
        fields = {f.name: f for f in msgspec.structs.fields(node)}
        if part not in fields:
            return None
        node = fields[part].type
    return node


def _known_keys(root: type, path: str) -> str:
    node = _field_type(root, path)
    if isinstance(node, type) and issubclass(node, msgspec.Struct):
        names = [f.name for f in msgspec.structs.fields(node) if f.name != "base_dir"]
        return f" (expected one of: {', '.join(names)})"
    return ""
