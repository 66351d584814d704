"""Named factories that a config section's ``type`` field picks: the built-in
rollout engines and trainer backends, and a user's, declared the same way.

    ENGINES = Registry("rollout.engine.type")
    ENGINES.register("vllm", "actors.engines.vllm_engine:VllmEngine.from_config", check=...)
    ENGINES.unavailable("vllm", cfg)    # why this machine cannot build it, or None
    ENGINES.factory("vllm")             # the factory, imported now

A ``type`` is a registered name or an import path ``package.module:attr``
(``attr`` may be dotted, ``Class.method``). A factory given as such a string is
imported only when a config names it, so an optional package (vLLM, SGLang,
megatron-core) is imported only where it is used. A name registered in code is
known only in the processes that ran the registration; an import path is known
in every process that can import it (the actors of ``runtime.type=process`` or
``ray`` build their engine from the config they are sent), and it is what the
run's saved config records.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "resolve_import_path"]

Section = TypeVar("Section")  # the config section the factories and checks take


@dataclass(frozen=True)
class _Entry(Generic[Section]):
    factory: str | Callable[..., Any]  # "package.module:attr", imported when used, or the callable
    check: Callable[[Section], str | None] | None  # the section -> why it cannot be built here, or None


class Registry(Generic[Section]):
    """The factories a config key (``key``, e.g. ``rollout.engine.type``) may name."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, _Entry[Section]] = {}

    def register(self, name: str, factory: str | Callable[..., Any], *,
                 check: Callable[[Section], str | None] | None = None) -> None:
        """Make ``name`` a value of :attr:`key`, built by ``factory`` (a callable, or the
        import path ``package.module:attr`` of one, imported when a config names it).
        ``check(section)``: why this machine cannot build it (a package missing, say),
        as one line, or None; it runs when the config loads. Registering a name again
        with the same factory and check does nothing; with another, raises ``ValueError``."""
        if not name or ":" in name:
            raise ValueError(f"{self.key}: a registered name has no ':' (that is an import path), got {name!r}")
        entry = _Entry(factory, check)
        if self._entries.setdefault(name, entry) != entry:
            raise ValueError(f"{self.key}: {name!r} is registered already, to {self._entries[name].factory!r}")

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order registered."""
        return tuple(self._entries)

    def unavailable(self, name: str, section: Section) -> str | None:
        """Why ``name`` cannot be built here from ``section``, as the tail of an error
        about :attr:`key` (one line); None when it can. An import path is imported now."""
        entry = self._entries.get(name)
        if entry is not None:
            return None if entry.check is None else entry.check(section)
        if ":" not in name:
            return (f"{name!r} is unknown (expected one of: {', '.join(self._entries)}; "
                    f"or an import path 'package.module:attr')")
        try:
            resolve_import_path(name)
        except ValueError as e:
            return str(e)
        return None

    def factory(self, name: str) -> Callable[..., Any]:
        """The factory ``name`` names, imported now (check :meth:`unavailable` first)."""
        entry = self._entries.get(name)
        target = name if entry is None else entry.factory
        return resolve_import_path(target) if isinstance(target, str) else target


def resolve_import_path(path: str) -> Callable[..., Any]:
    """The callable ``package.module:attr`` names (``attr`` may be dotted), imported now.
    Raises ``ValueError`` naming ``path`` when it does not import or is not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code makes the path unusable
        raise ValueError(f"{path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj
