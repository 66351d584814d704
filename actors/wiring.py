"""How a :class:`~actors.run.Run` is composed from its config: the runtime, the
TransferQueue, the trainer worker(s) and the rollout actors (each holding a queue
client), the weight link chosen by where they were placed, and the policy, which
drives them through their handles (control only). The policy math the actors run
(loss, advantages, task and reward, the resume-budget rule) is injected here as
module-level callables, which pickle by reference into any runtime."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import pathlib
import pickle
import sys
import time
from collections.abc import Awaitable, Callable

import msgspec
import torch

from actors import notebook
from actors.config import Config
from actors.mps import MpsDaemon
from actors.placement import Placer, reserve_roles
from actors.rollout import RolloutActor
from actors.runtime import Handle, Runtime, make_runtime
from actors.trainer import TrainerActor
from actors.trainer_group import TrainerGroup
import policies.losses
import policies.tasks
from contracts.handles import RolloutHandle, TrainerHandle
from contracts.rollout import SamplingParams
from policies import make_policy
from policies.base import PolicyBase
from policies.advantages import grpo_advantages
from policies.partial import absorb, next_request
from sync.link import TrainerLink, weight_sync_fn
from transfer_queue import TransferQueue
from transfer_queue.served import QueueHost, ServedDeployment, new_secret

__all__ = ["ByValue", "Wiring"]


class ByValue:
    """A function that pickle would send by name where a child process cannot find
    it (defined in ``__main__``: a notebook's, or a script's that spawn does not
    import again; inside another function; a lambda), sent by value with cloudpickle
    (Ray's copy, as Ray sends it) instead: it arrives as the function itself. Here
    it calls through, and looks like the function to ``inspect`` (``__wrapped__``)."""

    def __init__(self, fn: Callable[..., object]) -> None:
        functools.update_wrapper(self, fn)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.__wrapped__(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[bytes], object], tuple[bytes]]:
        try:
            import cloudpickle
        except ImportError:  # a dependency of Ray's, which ships its own copy
            from ray import cloudpickle
        return pickle.loads, (cloudpickle.dumps(self.__wrapped__),)


def _found_by_name(fn: object) -> bool:
    """Whether a child process finds ``fn`` by its module and qualified name (as pickle sends it)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or module == "__main__" or not qualname or module not in sys.modules:
        return False
    obj: object = sys.modules[module]
    for part in qualname.split("."):  # "<locals>" in a nested function's name is no attribute
        obj = getattr(obj, part, None)
    return obj is fn


class Wiring:
    """The part of :class:`~actors.run.Run` that composes it: ``_setup``, awaited once
    by its constructor, reads the run's ``cfg``, ``model_path`` and ``_task_data`` and
    sets its ``runtime``, ``queue``, ``weight_transport``, ``weight_mode`` and ``policy``."""

    cfg: Config
    model_path: str
    _task_data: dict[str, object]
    runtime: Runtime
    queue: TransferQueue
    weight_transport: str
    weight_mode: str  # full or delta: sync.mode over weight_transport (auto resolved, sync.auto.mode_for)
    policy: PolicyBase
    placer: Placer | None  # the run's Ray placement groups (actors/placement.py); None under local and process
    mps: MpsDaemon | None  # runtime.mps: the run's MPS control daemon (actors/mps.py)
    startup: dict[str, float]
    startup_actors: dict[str, dict[str, float]]  # each actor's start by part (Actor.startup_parts)

    async def _setup(self) -> None:
        """Compose the run: runtime, queue, actors (each holding a queue client),
        the weight link chosen by placement, the policy (control only). Each part's
        seconds go into ``startup`` (``mps_s`` with ``runtime.mps``, ``task_s``, ``runtime_s``,
        ``queue_s``, ``actors_s``:
        the trainer's and the rollout actors' processes started and set up, all at once:
        model and optimizer loaded, engines' weights and KV caches (compile and CUDA graphs
        where an engine does them at setup); ``weight_link_s``, ``policy_s``)."""
        cfg = self.cfg
        self._lap_at, lap = time.perf_counter(), self._lap
        self._setup_status = notebook.SetupStatus() if cfg.run.progress and notebook.interactive() else None

        # A cluster we start gets at least one logical CPU per actor, so a
        # laptop with fewer cores than actors still places them all (oversubscribed).
        num_cpus = cfg.runtime.num_cpus or max(os.cpu_count() or 1, 1 + cfg.rollout.num_actors)
        if cfg.runtime.mps:  # before any actor process starts: each is a client from its first CUDA call
            self.mps = MpsDaemon.start()
            lap("mps_s")
        self.runtime = make_runtime(cfg.runtime.type, address=cfg.runtime.address, num_cpus=num_cpus,
                                    connect_timeout_s=cfg.runtime.connect_timeout_s)
        if cfg.runtime.type == "local":
            torch.set_num_threads(1)
        if cfg.runtime.mps and cfg.runtime.mps_trainer_sm_percent is not None:  # the trainer's SMs, from its start
            self.runtime.env[TrainerActor] = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE":
                                              str(cfg.runtime.mps_trainer_sm_percent)}
        if cfg.runtime.type == "process":  # every process starts importing now, beside the others and the driver
            hosts_queue = cfg.transfer_queue.deployment != "ray"
            self.runtime.prestart({QueueHost: int(hosts_queue), TrainerActor: cfg.trainer.num_workers,
                                   RolloutActor: cfg.rollout.num_actors})
        lap("runtime_s")
        make_task_fn = functools.partial(policies.tasks.make_task, cfg.task.type, model_path=self.model_path,
                                         reward_timeout_s=cfg.policy.reward_timeout_s, **self._task_kwargs())
        task = make_task_fn()
        if cfg.policy.eval_every:  # a task without held-out prompts fails here, not at the first evaluation
            task.eval_prompts(cfg.policy.eval_prompts)
        lap("task_s")
        await self._reserve_roles()
        lap("roles_s")
        self.queue = await self._make_queue()
        lap("queue_s")
        r = cfg.rollout
        engine_gpus, engine_device = self._placement(r.engine.device)
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  stop_token_ids=tuple(task.stop_token_ids))

        async def spawn_rollout(i: int, replaces: str | None = None) -> Handle:
            options = await self.placer.actor_options("rollout", f"rollout-{i}", i, replaces) if self.placer else None
            return await self.runtime.spawn(
                RolloutActor, name=f"rollout-{i}", num_cpus=1, num_gpus=engine_gpus, ray_options=options,
                engine=msgspec.structs.replace(r.engine, device=engine_device), model_path=self.model_path,
                seed=cfg.run.seed + i, make_task=make_task_fn, sampling=sampling,
                max_response_tokens=r.max_response_tokens, partial_rollout=r.partial_rollout,
                next_request=next_request, absorb=absorb, queue=self.queue,
                reward_timeout_s=cfg.policy.reward_timeout_s, reward_workers=cfg.policy.reward_workers,
                torch_threads=1, mtp_layers=cfg.model.mtp_layers)

        trainer, rollouts = await self._start_actors(spawn_rollout)
        lap("actors_s")
        self.weight_transport, self.weight_mode = await self._open_weight_link(trainer, rollouts)
        lap("weight_link_s")
        replacement_index = itertools.count(r.num_actors)  # a replacement gets a name (and seed) of its own

        async def respawn_rollout(dead: Handle) -> Handle:
            """A new rollout actor for ``dead`` (its process ended: what the driver
            still holds for it is let go), its weight link open; the policy joins
            it to the broadcast group and pushes it the weights."""
            await self.runtime.stop(dead)
            new = await spawn_rollout(next(replacement_index), replaces=dead.name)  # in its bundle
            await new.open_weight_link(self.weight_transport)
            return new

        weight_sync = weight_sync_fn(self.weight_transport, cfg.sync.colocated,
                                     cfg.sync.in_flight_for(cfg.rollout.engine.type))
        self.policy = make_policy(cfg, rollouts=rollouts, trainer=trainer, queue=self.queue, task=task,
                                  weight_sync=weight_sync,
                                  respawn_rollout=respawn_rollout if r.max_respawns else None)
        lap("policy_s")

    def _lap(self, phase: str) -> None:
        """Setup's ``phase`` ended now (its seconds into ``startup``); the status line names the next."""
        now = time.perf_counter()
        self.startup[phase], self._lap_at = now - self._lap_at, now
        if self._setup_status is not None and not self._setup_status.lap(phase):
            self._end_setup_status()

    def _end_setup_status(self) -> None:
        """Close the setup status line (set up, or failed)."""
        status, self._setup_status = getattr(self, "_setup_status", None), None
        if status is not None:
            status.close()

    async def _start_actors(self, spawn_rollout: Callable[[int], Awaitable[Handle]]
                            ) -> tuple[Handle | TrainerGroup, list[Handle]]:
        """The trainer (its workers) and the rollout actors (``spawn_rollout(i)``)
        started and set up all at once (model loads, engines' caches): the workers must
        (their setup joins one group), and the rest need not wait for each other.
        Raises the first failure once every spawn has ended, so the runtime holds every
        actor it made, to stop."""
        cfg = self.cfg
        trainer_gpus, trainer_device = self._placement(cfg.trainer.device)
        n = cfg.trainer.num_workers
        group_init = TrainerLink.rendezvous() if n > 1 else None  # the workers' own group meets here
        spawned = await asyncio.gather(*(self.runtime.spawn(
            TrainerActor, name="trainer" if n == 1 else f"trainer-{rank}", num_cpus=1, num_gpus=trainer_gpus,
            trainer=msgspec.structs.replace(cfg.trainer, device=trainer_device), sync=cfg.sync,
            model_path=self.model_path, seed=cfg.run.seed, loss=policies.losses.make_loss_from_config(cfg.trainer),
            advantages=grpo_advantages, queue=self.queue, engine_dtype=cfg.rollout.engine.dtype,
            torch_threads=1, rank=rank, world_size=n, group_init=group_init, mtp_layers=cfg.model.mtp_layers,
            ray_options=self._where("trainer", rank))
            for rank in range(n)), *(spawn_rollout(i) for i in range(cfg.rollout.num_actors)),
            return_exceptions=True)
        failed = [x for x in spawned if isinstance(x, BaseException)]
        if failed:
            raise failed[0]
        timings = await asyncio.gather(*(h.startup_timings() for h in spawned))
        self.startup_actors.update({h.name: {k: round(v, 3) for k, v in t.items()} for h, t in zip(spawned, timings)})
        workers = spawned[:n]
        return (workers[0] if n == 1 else TrainerGroup(list(workers))), list(spawned[n:])

    def _task_kwargs(self) -> dict[str, object]:
        """``task.kwargs`` with data files (``path``, ``eval_path``) made absolute: a
        relative one is tried against the config file's directory, then the current
        one, as ``model.path`` is (actors in other processes may run elsewhere); a
        reward function (``launch(reward=fn)``) that a child process could not find
        by name, sent by value (:class:`ByValue`)."""
        kwargs = {**self.cfg.task.kwargs, **self._task_data}
        reward = kwargs.get("reward")
        if callable(reward) and self.cfg.runtime.type != "local" and not _found_by_name(reward):
            kwargs["reward"] = ByValue(reward)
        for key in ("path", "eval_path"):
            value = kwargs.get(key)
            if isinstance(value, str) and value and not pathlib.Path(value).expanduser().is_absolute():
                near_config = pathlib.Path(self.cfg.base_dir) / value
                kwargs[key] = str((near_config if near_config.exists() else pathlib.Path.cwd() / value).resolve())
        return kwargs

    async def _make_queue(self) -> TransferQueue:
        """The TransferQueue and the driver's client of it. Under ``process`` and
        ``ray`` the ``local`` deployment lives in a queue-host actor, not here:
        the driver only sends control calls (statistics, close)."""
        q = self.cfg.transfer_queue
        if self.cfg.runtime.type == "local" or q.deployment == "ray":
            if q.deployment == "ray":
                self.runtime.connect()  # the queue's actors join the cluster the runtime uses
            placed = self.placer.queue_options(q.num_storage_units) if self.placer is not None else None
            return await TransferQueue.create(q, ray_options=placed)
        secret = new_secret()
        host = await self.runtime.spawn(QueueHost, q, secret, name="transfer-queue", num_cpus=0,
                                        ray_options=self._where("storage", 0))
        return TransferQueue(q, ServedDeployment(await host.address(), secret, q.rpc_limits))

    async def _open_weight_link(self, trainer: TrainerHandle, rollouts: list[RolloutHandle]) -> tuple[str, str]:
        """Pick the weight transport from where the actors run (``sync.transport``
        can force one) and open it at both ends (``sync.link.open_weight_link``);
        returns its name and the kind pushed over it (``sync.mode``, ``auto`` resolved)."""
        from sync.link import open_weight_link

        return await open_weight_link(trainer, rollouts, self.cfg.sync, sources=self.cfg.trainer.num_workers)

    async def _reserve_roles(self) -> None:
        """Under Ray, each role's placement group, placed (``actors/placement.py``)."""
        cfg = self.cfg
        storage_cpus = cfg.transfer_queue.ray_num_cpus if cfg.transfer_queue.deployment == "ray" else 0
        self.placer = await reserve_roles(cfg, self.runtime, {
            "trainer": (1, self._placement(cfg.trainer.device)[0]),
            "rollout": (1, self._placement(cfg.rollout.engine.device)[0]), "storage": (storage_cpus, 0)})

    def _where(self, role: str, index: int) -> dict[str, object] | None:
        """Ray options putting actor ``index`` of ``role`` in its placement-group bundle."""
        return self.placer.options(role, index) if self.placer is not None else None

    def _placement(self, device: str) -> tuple[float, str]:
        """Ray GPUs to reserve for an actor on ``device``, and the device name
        inside it (Ray shows an actor only its own GPUs, as cuda:0)."""
        if self.cfg.runtime.type != "ray" or not device.startswith("cuda"):
            return 0, device
        return (0.5 if self.cfg.sync.colocated else 1), "cuda"
