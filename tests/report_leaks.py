"""Rollout actors that hide their samples' token ids in the group reports they
hand the driver: the mutations the direct-path check must catch
(``tests/test_direct_paths.py``). A test puts one in place of
``actors.wiring.RolloutActor``, the class the composition root spawns; the
runtime sends the class by name, so the mutation runs in the actor's own
process (``process``, ``ray``) while the library's code stays as it is.

Each report carries ``LEAKED_IDS`` token ids of its group's responses (the
first ones, in sample order): as few as one response of the tests' runs has
(``rollout.max_response_tokens=8``), so a budget that misses them misses a
sample.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.rollout import RolloutActor
from contracts.rollout import GroupReport, GroupRequest
from contracts.sample import Sample

__all__ = ["LEAKED_IDS", "IdsAsList", "IdsAsText", "ReportWithIds"]

LEAKED_IDS = 8


class ReportWithIds(GroupReport, kw_only=True):
    """A group report with a field no report has: token ids."""

    token_ids: list[int] = msgspec.field(default_factory=list)


class _LeakingIds(RolloutActor):
    """A rollout actor that keeps each finished response's ids by group and
    hides ``LEAKED_IDS`` of them in the group's report (:meth:`leak`)."""

    async def setup(self) -> None:
        await super().setup()
        self._responses: dict[str, list[int]] = {}

    async def _generate_one(self, sample: Sample, sampling: Any = None) -> None:
        await super()._generate_one(sample, sampling)
        self._responses.setdefault(sample.group_id, []).extend(int(t) for t in sample.response_ids)

    async def generate_group(self, group: GroupRequest) -> GroupReport:
        report = await super().generate_group(group)
        ids = self._responses.pop(group.group_id, [])[:LEAKED_IDS]
        return self.leak(report, ids + [0] * (LEAKED_IDS - len(ids)))

    def leak(self, report: GroupReport, ids: list[int]) -> GroupReport:
        raise NotImplementedError


class IdsAsList(_LeakingIds):
    """The ids as a list field of their own: a short list of ``LEAKED_IDS`` numbers."""

    def leak(self, report: GroupReport, ids: list[int]) -> GroupReport:
        return ReportWithIds(**msgspec.structs.asdict(report), token_ids=ids)


class IdsAsText(_LeakingIds):
    """The ids as a string, in the report's one string field a report without a
    reward error leaves empty: ``"5 12 7 3 18 2 9 11"``."""

    def leak(self, report: GroupReport, ids: list[int]) -> GroupReport:
        return msgspec.structs.replace(report, reward_error=" ".join(map(str, ids)))
