"""Roles on a Ray cluster: each role's actors (rollout actors, trainer workers,
queue storage units) in a placement group of its own, one bundle per actor, with
the role's strategy (``runtime.placement``, ``actors/placement_config.py``).

    load:     role_plans(cfg) ─► check_fits(plans, ray.nodes())    one line naming the role and what is missing
              ─► placement_group(bundles, strategy) per role ─► placed within ready_timeout_s (the backstop:
                 resources others hold)
    spawn:    options(role, i): the actor's resources + PlacementGroupSchedulingStrategy(pg, bundle i)
    node lost: Ray places the lost node's bundles again on the nodes left when they fit;
              a replacement (rollout actor: the policy's; storage unit: the queue controller's)
              waits (ready_timeout_s) for its bundle, else it is given up with one line

The feasibility check is the cluster's nodes (alive, their total resources and
labels) against the bundles, role after role, as Ray's strategies would place
them; Ray alone knows what other jobs hold, hence the ``ready`` backstop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import msgspec

from actors.config_yaml import ConfigError
from actors.placement_config import PlacementConfig, RoleConfig

__all__ = ["PlacementError", "Placer", "RolePlan", "check_fits", "reserve_roles", "role_plans"]

ROLES = ("trainer", "rollout", "storage")
# What an actor that asks for nothing reserves: Ray has no empty bundles, and a bundle is
# what carries the role's strategy and labels (a queue storage unit reserves no CPU by
# default). Ray's logical ``memory`` (bytes; every node offers its RAM): no CPU is taken.
MIN_BUNDLE = {"memory": float(1 << 20)}
_POLL_S = 0.1


class PlacementError(ConfigError):
    """The cluster cannot hold a role as configured (one line: the role, what is missing)."""


class RolePlan(msgspec.Struct, frozen=True, kw_only=True):
    """One placement group: its bundles, strategy and the node labels each bundle
    needs; ``actors``: role -> the bundle of each of its actors; ``shares``: role ->
    what each of its actors reserves of its bundle (all of it unless colocated).
    ``role`` names it in errors: the trainer's group holds the rollout actors too
    when colocated."""

    role: str
    bundles: list[dict[str, float]]
    strategy: str
    labels: list[dict[str, str]]
    actors: dict[str, list[int]]
    shares: dict[str, dict[str, float]]


def _bundle(role: RoleConfig, num_cpus: float, num_gpus: float) -> dict[str, float]:
    cpus = num_cpus if role.num_cpus is None else role.num_cpus
    gpus = num_gpus if role.num_gpus is None else role.num_gpus
    return {k: v for k, v in {"CPU": cpus, "GPU": gpus, **role.resources}.items() if v} or dict(MIN_BUNDLE)


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return dict(Counter(a) + Counter(b))


def role_plans(p: PlacementConfig, counts: dict[str, int], defaults: dict[str, tuple[float, float]]) -> list[RolePlan]:
    """The placement groups of a run: ``counts`` (actors per role) and ``defaults``
    (role -> its default CPUs and GPUs per actor); an actor asking for nothing
    reserves ``MIN_BUNDLE``."""
    each = {r: _bundle(getattr(p, r), *defaults[r]) for r in ROLES}
    plans = []
    roles = [r for r in ROLES if counts.get(r)]
    if p.colocate:
        n = max(counts["trainer"], counts["rollout"])
        bundles = [_add(each["trainer"] if i < counts["trainer"] else {},
                        each["rollout"] if i < counts["rollout"] else {}) for i in range(n)]
        labels = {**p.rollout.labels, **p.trainer.labels}
        plans.append(RolePlan(role="trainer", bundles=bundles, strategy=p.trainer.strategy,
                              labels=[labels] * n, actors={r: list(range(counts[r])) for r in ("trainer", "rollout")},
                              shares={r: each[r] for r in ("trainer", "rollout")}))
        roles = [r for r in roles if r not in ("trainer", "rollout")]
    for r in roles:
        plans.append(RolePlan(role=r, bundles=[each[r]] * counts[r], strategy=getattr(p, r).strategy,
                              labels=[getattr(p, r).labels] * counts[r], actors={r: list(range(counts[r]))},
                              shares={r: each[r]}))
    return plans


# ------------------------------------------------------------- feasibility
def _fits(need: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v - 1e-9 for k, v in need.items())


def _has(labels: dict[str, str], node: dict[str, object]) -> bool:
    return all(node["labels"].get(k) == v for k, v in labels.items())


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {int(v) if v == int(v) else f'{v:g}'}" for k, v in bundle.items()) + "}"


def _missing(plan: RolePlan, nodes: list[dict[str, object]]) -> str:
    """What the cluster lacks for ``plan`` (the first reason found), for the one line."""
    bundle = plan.bundles[0]
    n = len(plan.bundles)
    labelled = [x for x in nodes if _has(plan.labels[0], x)]
    if plan.labels[0] and not labelled:
        return f"no node has the labels {plan.labels[0]}"
    for k, v in bundle.items():
        total = sum(x["free"].get(k, 0.0) for x in labelled)
        if total < v * n - 1e-9 or not any(x["free"].get(k, 0.0) >= v - 1e-9 for x in labelled):
            have = ", ".join(f"{x['free'].get(k, 0.0):g}" for x in labelled)
            return (f"{n} × {v:g} {k} are needed, {total:g} left on its nodes ({have} per node)" if total < v * n
                    else f"no node has {v:g} {k} left ({have} per node)")
    if plan.strategy == "STRICT_SPREAD":
        fit = sum(_fits(bundle, x["free"]) for x in labelled)
        return f"STRICT_SPREAD needs {n} nodes with {_fmt(bundle)} each, {fit} have it"
    if plan.strategy == "STRICT_PACK":
        return f"STRICT_PACK needs one node with {_fmt(_sum(plan.bundles))}, none has it"
    return f"its {n} bundles of {_fmt(bundle)} do not fit the nodes' resources left"


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for b in bundles:
        total = _add(total, b)
    return total


def _place(plan: RolePlan, nodes: list[dict[str, object]]) -> bool:
    """Take ``plan``'s bundles out of ``nodes``' free resources as its strategy would; False if they do not fit."""
    order = sorted(range(len(plan.bundles)), key=lambda i: -sum(plan.bundles[i].values()))
    if plan.strategy == "STRICT_PACK":
        total = _sum(plan.bundles)
        node = next((x for x in nodes if _has(plan.labels[0], x) and _fits(total, x["free"])), None)
        if node is None:
            return False
        node["free"] = dict(Counter(node["free"]) - Counter(total))
        return True
    used: set[int] = set()
    for i in order:
        candidates = [j for j, x in enumerate(nodes) if _has(plan.labels[i], x) and _fits(plan.bundles[i], x["free"])
                      and not (plan.strategy == "STRICT_SPREAD" and j in used)]
        if not candidates:
            return False
        j = max(candidates, key=lambda j: sum(nodes[j]["free"].values()))  # the roomiest: spreads, and fits first
        used.add(j)
        nodes[j]["free"] = dict(Counter(nodes[j]["free"]) - Counter(plan.bundles[i]))
    return True


def check_fits(plans: list[RolePlan], ray_nodes: list[dict[str, object]]) -> None:
    """Raise :class:`PlacementError` (one line) for the first role the cluster's alive
    nodes cannot hold, after the roles before it took their share."""
    nodes = [{"free": dict(x["Resources"]), "labels": dict(x.get("Labels") or {})} for x in ray_nodes if x["Alive"]]
    for plan in plans:
        before = [dict(x["free"]) for x in nodes]
        if not _place(plan, nodes):
            for x, free in zip(nodes, before):
                x["free"] = free
            with_rollout = " with the rollout actors, colocate" if len(plan.actors) > 1 else ""
            raise PlacementError(f"runtime.placement.{plan.role}: the cluster ({len(nodes)} nodes) cannot hold "
                                 f"{len(plan.bundles)} × {_fmt(plan.bundles[0])} ({plan.strategy}{with_rollout}): "
                                 f"{_missing(plan, nodes)}")


# ------------------------------------------------------------- the groups
class Placer:
    """The run's placement groups (made by :meth:`reserve`, removed by :meth:`release`)
    and the Ray options that put each actor in its bundle."""

    def __init__(self, plans: list[RolePlan], ready_timeout_s: float) -> None:
        self.plans, self.ready_timeout_s = plans, ready_timeout_s
        self._groups: dict[str, object] = {}  # plan role -> placement group
        self._slot_of: dict[str, int] = {}  # actor name -> the slot (actor index) of its role it holds

    async def reserve(self) -> None:
        """Check the plans against the cluster, then make every group and wait until
        it is placed; either failing is a :class:`PlacementError`, never a hang."""
        import ray  # ~0.75 s to import: only Ray runs pay it
        from ray.util import placement_group

        check_fits(self.plans, ray.nodes())
        for plan in self.plans:
            selector = plan.labels if any(plan.labels) else None
            self._groups[plan.role] = placement_group(plan.bundles, strategy=plan.strategy,
                                                      bundle_label_selector=selector)
        for plan in self.plans:
            await self._wait_placed(plan, "at load")

    def _plan_of(self, role: str) -> RolePlan | None:
        return next((p for p in self.plans if role in p.actors), None)

    async def _wait_placed(self, plan: RolePlan, when: str) -> None:
        """Until every bundle of ``plan``'s group sits on a node, for ``ready_timeout_s``."""
        from ray.util import placement_group_table

        group = self._groups[plan.role]
        deadline = time.monotonic() + self.ready_timeout_s
        while (state := placement_group_table(group)["state"]) != "CREATED":
            if time.monotonic() > deadline or state == "REMOVED":
                raise PlacementError(self._not_placed(plan, when))
            await asyncio.sleep(_POLL_S)

    def _not_placed(self, plan: RolePlan, when: str) -> str:
        import ray  # ~0.75 s to import: only Ray runs pay it

        try:
            check_fits([plan], ray.nodes())
            why = "its resources are held by other actors or jobs (ray status shows them)"
        except PlacementError as err:
            why = str(err).split(": ", 1)[1]
        return (f"runtime.placement.{plan.role}: its placement group was not placed {when} within "
                f"runtime.placement.ready_timeout_s={self.ready_timeout_s:g}: {why}")

    def options(self, role: str, index: int) -> dict[str, object] | None:
        """Ray actor options putting actor ``index`` of ``role`` in its bundle (None:
        the run has no such actor)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan = self._plan_of(role)
        if plan is None:
            return None
        own = dict(plan.shares[role])
        return {"num_cpus": own.pop("CPU", 0), "num_gpus": own.pop("GPU", 0), "memory": own.pop("memory", 0),
                "resources": own,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self._groups[plan.role],
                                                                        plan.actors[role][index])}

    async def actor_options(self, role: str, name: str, index: int,
                            replaces: str | None = None) -> dict[str, object] | None:
        """:meth:`options` of actor ``name``, the ``index``-th of ``role``; a replacement of the
        actor named ``replaces`` takes its bundle, once that is placed again (its node may be
        gone): a :class:`PlacementError` if it is not within ``ready_timeout_s``."""
        slot = index if replaces is None else self._slot_of.get(replaces, 0)
        plan = self._plan_of(role)
        if replaces is not None and plan is not None:
            await self._wait_placed(plan, "again for a replacement")
        self._slot_of[name] = slot
        return self.options(role, slot)

    def release(self) -> None:
        """Remove the groups (their actors are gone or going)."""
        from ray.util import remove_placement_group

        groups, self._groups = self._groups, {}
        for group in groups.values():
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - a cluster already gone took them with it
                pass

    def queue_options(self, num_units: int) -> dict[str, object]:
        """``TransferQueue.create``'s ``ray_options``: each storage unit in its bundle,
        the controller on the driver's node (whose loss ends the run anyway). A unit
        lost with its node is replaced in the same bundle, once Ray placed it again on
        the nodes left, within ``ready_timeout_s`` (else it is given up, one line)."""
        import ray  # ~0.75 s to import: only Ray runs pay it
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        driver_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return {"unit_options": [self.options("storage", i) for i in range(num_units)],
                "controller_options": {"scheduling_strategy": driver_node},
                "replace_timeout_s": self.ready_timeout_s}


async def reserve_roles(cfg: Any, runtime: Any, defaults: dict[str, tuple[float, float]]) -> Placer | None:
    """The run's placement groups, placed (``runtime.type=ray`` only; None otherwise),
    owned by ``runtime`` (removed at its shutdown). ``defaults``: role -> the CPUs and
    GPUs each of its actors reserves unless ``runtime.placement`` says otherwise."""
    if cfg.runtime.type != "ray":
        return None
    runtime.connect()
    q = cfg.transfer_queue
    counts = {"trainer": cfg.trainer.num_workers, "rollout": cfg.rollout.num_actors,
              "storage": q.num_storage_units if q.deployment == "ray" else 1}
    p = cfg.runtime.placement
    runtime.placer = placer = Placer(role_plans(p, counts, defaults), p.ready_timeout_s)
    await placer.reserve()
    return placer
