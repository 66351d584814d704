"""``auto`` mode: pick full or delta per sync from measured cost.

A full push costs about the same every time; a delta's cost grows with the
fraction of changed elements and with how fast the link is compared to
encoding. On a GPU where a same-device full copy takes milliseconds the
delta's compare-and-compress can be the slower one, so neither is always
right. We keep an exponential moving average of the measured end-to-end
milliseconds (encode + transfer + apply) per kind, take the cheaper, and
re-measure the other kind every ``probe_every`` syncs so the estimate
follows a changing learning rate. The first measurement of each kind is a
warm-up: it carries one-time costs (the receiving process's first mapping of
CUDA IPC buffers, first allocations), so the second replaces it, and each kind
is measured twice before the cheaper one is chosen.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Kind = Literal["full", "delta"]


class AutoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``alpha``: EMA weight of the newest measurement, in (0, 1].
    ``probe_every``: syncs between re-measurements of the kind not chosen (>= 2)."""

    alpha: float = 0.5
    probe_every: int = 10
    assumed_bytes_per_s: float = 2e9
    """Link speed assumed for a sync nobody reported on (``WeightSender.observe``
    not called): its cost is taken as encode time + bytes / this."""

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"AutoConfig.alpha must be in (0, 1], got {self.alpha}")
        if self.probe_every < 2:
            raise ValueError(f"AutoConfig.probe_every must be >= 2, got {self.probe_every}")
        if self.assumed_bytes_per_s <= 0:
            raise ValueError(f"AutoConfig.assumed_bytes_per_s must be > 0, got {self.assumed_bytes_per_s}")


class AutoPolicy:
    """Chooses the kind of the next update; learns from :meth:`observe`."""

    def __init__(self, config: AutoConfig | None = None) -> None:
        self.config = config or AutoConfig()
        self.cost_ms: dict[Kind, float | None] = {"full": None, "delta": None}
        self.num_observed: dict[Kind, int] = {"full": 0, "delta": 0}
        self._since_probe = 0

    def observe(self, kind: Kind, total_ms: float) -> None:
        """Record the measured end-to-end cost of one sync of ``kind``."""
        old = self.cost_ms[kind]
        a = self.config.alpha
        warm_up = self.num_observed[kind] <= 1  # the first one's one-time costs are not kept
        self.cost_ms[kind] = total_ms if old is None or warm_up else a * total_ms + (1 - a) * old
        self.num_observed[kind] += 1

    def choose(self) -> Kind:
        """The kind expected to be cheaper; each kind is measured twice first."""
        full, delta = self.cost_ms["full"], self.cost_ms["delta"]
        if delta is None:
            return "delta"
        for kind in ("full", "delta"):
            if self.num_observed[kind] < 2:
                return kind  # type: ignore[return-value]
        assert full is not None
        best: Kind = "full" if full < delta else "delta"
        self._since_probe += 1
        if self._since_probe >= self.config.probe_every:
            self._since_probe = 0
            return "delta" if best == "full" else "full"
        return best
