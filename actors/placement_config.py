"""PlacementConfig: the ``runtime.placement`` section. What each role of a run
asks of a Ray cluster (rollout actors, trainer workers, queue storage units) and
how its actors spread over the nodes; ``actors/placement.py`` turns it into Ray
placement groups. Used with ``runtime.type=ray`` only."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["PlacementConfig", "RoleConfig", "Strategy"]

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
NonNegFloat = Annotated[float, Meta(ge=0)]


class RoleConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What each actor of one role asks of the cluster (one placement-group bundle
    each), and how the role's bundles spread over its nodes."""

    num_cpus: NonNegFloat | None = None
    """Logical CPUs each actor reserves. ``null``: the role's default (1 for a rollout
    actor or a trainer worker; ``transfer_queue.ray_num_cpus`` for a storage unit)."""
    num_gpus: NonNegFloat | None = None
    """GPUs each actor reserves. ``null``: from its device (``rollout.engine.device``,
    ``trainer.device``): 1 on ``cuda`` (0.5 with ``sync.colocated``), 0 on ``cpu``."""
    resources: dict[str, Annotated[float, Meta(gt=0)]] = {}
    """Custom resources each actor reserves, as nodes offer them (``ray start
    --resources='{"trainer_node": 1}'``): a resource only some nodes have pins the
    role to those nodes."""
    labels: dict[str, str] = {}
    """Node labels each actor's node must carry (``ray start --labels``), e.g.
    ``{accelerator: H200}``."""
    strategy: Strategy = "PACK"
    """How the role's bundles spread over nodes (a Ray placement-group strategy):
    ``PACK`` as few nodes as fit, ``SPREAD`` as many as there are, ``STRICT_PACK``
    one node or refused, ``STRICT_SPREAD`` one node per actor or refused."""


class PlacementConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Ray only: each role's resources and placement strategy, one placement group
    per role (an actor that asks for nothing reserves 1 MiB of Ray's logical memory:
    its bundle carries the strategy and labels). A placement the cluster cannot hold
    stops the run at load with one line naming the role and what is missing."""

    rollout: RoleConfig = RoleConfig()
    """Each rollout actor (its engine with it)."""
    trainer: RoleConfig = RoleConfig()
    """Each trainer worker (``trainer.num_workers``)."""
    storage: RoleConfig = RoleConfig()
    """Each TransferQueue storage unit (``transfer_queue.deployment=ray``), or the one
    queue-host actor of the ``local`` deployment. The queue's controller runs on the
    driver's node."""
    colocate: bool = False
    """Trainer worker i and rollout actor i share bundle i of one placement group
    (the trainer's strategy and labels; each actor reserves its own share of it),
    e.g. both on one GPU with ``num_gpus: 0.5`` and ``sync.colocated: true``.
    ``false``: each role has a placement group of its own (disaggregated)."""
    ready_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    """How long the placement groups may take to be placed at load, and a lost
    node's bundles to be placed again for a replacement, before the run stops (or
    the replacement is given up, counted) with one line saying what is missing."""
