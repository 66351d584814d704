"""Errors raised by weight sync. Every one of them means: the receiver's
weights are exactly what they were before the failed update (unless the
class says otherwise)."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed; the receiver is unchanged."""


class BaseVersionMismatch(WeightSyncError):
    """A delta was built against a version the receiver does not hold.
    The fix is a full push (``WeightSender.force_full``)."""

    def __init__(self, base_version: int | None, current_version: int) -> None:
        super().__init__(
            f"delta update has base version {base_version} but the receiver holds "
            f"version {current_version}; a full update is needed"
        )
        self.base_version = base_version
        self.current_version = current_version


class ChecksumError(WeightSyncError):
    """A payload or a resulting tensor does not match its manifest checksum."""


class ManifestMismatch(WeightSyncError):
    """The manifest names a tensor the receiver lacks, or a different shape."""


class SyncFailed(WeightSyncError):
    """A sync over several engines failed. ``engine_index`` is the first engine
    that failed; ``versions`` the version each engine holds afterwards."""

    def __init__(self, message: str, engine_index: int, versions: list[int]) -> None:
        super().__init__(f"{message} (engine {engine_index}; versions now {versions})")
        self.engine_index = engine_index
        self.versions = versions
