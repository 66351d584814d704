"""A config's text read into a raw tree: the YAML file (``read_yaml``) and the
``key.path=value`` overrides applied on top of it (``apply_overrides``), each
wrong input a :class:`ConfigError` of one line. ``actors/config.py`` decodes the
tree into the typed sections and checks it."""

from __future__ import annotations

import pathlib
import re

import yaml

__all__ = ["ConfigError", "apply_overrides", "read_yaml"]


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``2e-6`` as a float (YAML 1.2), not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_scalar(text: str) -> object:
    try:
        return yaml.load(text, Loader=_Loader) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict[str, object], dotted: str, value: object) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, object], overrides: list[str]) -> dict[str, object]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise ConfigError(f"override {item!r}: expected key.path=value")
        _set_dotted(tree, key, _parse_scalar(raw))
    return tree


def read_yaml(p: pathlib.Path) -> dict[str, object]:
    """The mapping of sections in config file ``p``; :class:`ConfigError` (one line)
    for a file that cannot be read, is binary, is not UTF-8, is empty or is not YAML."""
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config file ({err.strerror or err})") from None
    if b"\0" in data:
        raise ConfigError(f"{p}: a binary file (NUL byte at offset {data.index(0)}), not a YAML config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}): a binary "
                          "file, or text in another encoding; a config is UTF-8 YAML") from None
    try:
        tree = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{p}: malformed YAML{where}: {problem}") from None
    except (ValueError, RecursionError) as err:  # a scalar YAML accepts but cannot build (a bad date), nesting
        raise ConfigError(f"{p}: malformed YAML: {type(err).__name__}: {err}") from None
    if tree is None:
        raise ConfigError(f"{p}: the config file is empty (expected a mapping of sections: run, policy, ...)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    return tree
