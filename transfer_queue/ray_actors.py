"""The Ray deployment's actors: each storage unit, and the controller, in a
process of its own (``ray_deploy.py`` draws the calls between them and the client).

    StorageActor     one storage unit's rows; a put of new samples stores them, then has
                     the controller register and commit them (``reserve_new``)
    ControllerActor  the controller (``controller.py``) behind a socket; it replaces a
                     storage unit that died, placed as the lost one was (``unit_lost``)

Both serve their calls over ``rpc.py``'s sockets on Ray's (uvloop) loop, which
they adopt as their process's one loop; Ray itself carries only the rare calls
that hold actor handles (setup, a unit's loss and replacement).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import ray

import loop
from contracts.placement import node_address
from transfer_queue.coalesce import ReserveRefused
from transfer_queue.codec import decode_raw_row, decode_raw_rows, decode_tags, encode_rows
from transfer_queue.config import RpcLimits, TransferQueueConfig
from transfer_queue.controller import Controller
from transfer_queue.deploy_local import _shard
from transfer_queue.rpc import RpcClient, RpcServer
from transfer_queue.storage import StorageUnit
from transfer_queue.wire import SampleTags

__all__ = ["REPLACE_TIMEOUT_S", "Address", "ControllerActor", "StorageActor", "UnitState", "unwrap"]

log = logging.getLogger(__name__)
T = TypeVar("T")

Address = tuple[str, int]

# How long a replacement storage unit may take to be placed and serve, unless create() says.
REPLACE_TIMEOUT_S = 60.0


class UnitState(msgspec.Struct, frozen=True, kw_only=True):
    """What the controller knows of one storage unit, for a client to route by."""

    generation: int  # actors that served it before this one (replacements so far)
    first_slot: int  # its slots below this were on an actor that died: their rows are gone
    live: bool  # an actor serves it now; False: lost, a replacement starting or given up
    actor: object  # the Ray actor of this generation
    address: Address  # where that actor listens
    gone: str | None = None  # why no replacement is coming; None: it is live, or one is starting


@ray.remote
class StorageActor:
    """One storage unit in its own process. An async actor: its methods run one
    at a time on the actor's loop (none awaits while touching the rows).

    New samples' rows are kept whole (``put_new``); rows of ``put_fields`` writes
    arrive as one msgpack buffer and are parsed into per-field slices on the next
    read or delete, so a write's round trip is only the transfer.
    """

    SERVED = ("put_new", "put_commit", "put", "get", "delete", "num_rows")

    def __init__(self, unit_id: int, secret: bytes, limits: RpcLimits | None = None) -> None:
        self._unit = StorageUnit(unit_id)
        self._secret, self._limits = secret, RpcLimits(**(limits or {}))
        self._controller: RpcClient  # connect() makes it, once the controller serves
        self._unparsed: collections.deque[tuple[list[int], bytes]] = collections.deque()
        # Rows of new samples kept whole (a msgpack slice of their write, never parsed): a
        # read of whole rows copies them out as they are. Parsed into ``_unit`` (field ->
        # slice) only when fields are added to them or a read asks for some fields.
        self._whole: dict[int, msgspec.Raw] = {}
        self.num_stored = 0  # rows of new samples received since it started (a diagnostic)

    async def serve(self, ports: tuple[int, int] | None = None) -> Address:
        loop.adopt()  # Ray's loop (uvloop, see loop/) is this process's one loop; the RPC server runs on it
        self._server = RpcServer(self, self.SERVED, self._secret, **self._limits)
        return await self._server.start(node_address(), ports)

    async def loop_info(self) -> tuple[str, bool]:
        """The class of the loop this actor runs on (``uvloop.Loop``), and whether it is
        this process's asyncrl loop: a diagnostic, called through Ray."""
        return loop.loop_name(), loop.in_loop()

    def connect(self, controller: Address) -> int:
        self._controller = RpcClient(controller, self._secret, "the TransferQueue controller", **self._limits)
        return self._unit.unit_id

    def put(self, indices: list[int], buf: bytes) -> None:
        self._unparsed.append((indices, buf))

    def _parse(self) -> None:
        while self._unparsed:
            indices, buf = self._unparsed.popleft()
            self._unwhole(indices)  # fields added to a whole row: parse it first, then merge
            self._unit.put_rows(indices, decode_raw_rows(buf))

    def _unwhole(self, indices: Sequence[int]) -> None:
        if self._whole:
            for i in indices:
                row = self._whole.pop(i, None)
                if row is not None:
                    self._unit.put_rows([i], [decode_raw_row(row)])

    async def put_new(
        self,
        partition: str,
        tags_buf: bytes,
        indices: list[int],
        row_lengths: list[int],
        wait: bool,
        timeout_s: float | None,
        buf: bytes,
    ) -> list[int]:
        """Store new samples' rows (msgpack maps back to back, ``row_lengths`` bytes each), then
        have the controller register and commit them (``Controller.reserve``); returns its
        placement (-1: dropped on arrival). A refusal (QueueFull, a bad uid, closed, timeout)
        deletes the rows and raises ``ReserveRefused``: nothing was registered."""
        view = memoryview(buf)
        start = 0
        for index, n in zip(indices, row_lengths, strict=True):
            self._whole[index] = msgspec.Raw(view[start : start + n])
            start += n
        self.num_stored += len(indices)
        try:
            placed = await self._controller.call("reserve_new", partition, tags_buf, indices, wait, timeout_s)
        except Exception as e:
            self.delete(indices)
            raise ReserveRefused(e) from None
        dead = [i for i, index in zip(indices, placed) if index < 0]  # their group is dead: not kept
        if dead:
            self.delete(dead)
        return placed

    async def put_commit(self, indices: list[int], all_indices: list[int], tags: list[SampleTags], buf: bytes
                         ) -> None:
        """Store the rows, then commit them at the controller: one client message per write."""
        self.put(indices, buf)
        await self._controller.call("call", "commit", all_indices, tags)

    def get(self, indices: list[int], fields: Sequence[str] | None) -> np.ndarray:
        """The rows as one msgpack buffer, as a uint8 array (it travels out of band)."""
        self._parse()
        if fields is None:
            try:  # whole rows as they came: one copy into the reply
                return np.frombuffer(encode_rows([self._whole[i] for i in indices]), np.uint8)
            except KeyError:  # some were parsed (fields added): the general path below
                pass
        self._unwhole(indices)
        return np.frombuffer(self._unit.get_encoded(indices, fields), np.uint8)

    def delete(self, indices: list[int]) -> None:
        self._parse()
        for i in indices:
            self._whole.pop(i, None)
        self._unit.delete(indices)

    def num_rows(self) -> int:
        self._parse()
        return len(self._whole) + len(self._unit)


@ray.remote
class ControllerActor:
    """The controller in its own process (an async actor: waiting gets and puts
    each hold a coroutine, not a thread). It also replaces storage units that died
    (it owns the replacements: they end with it)."""

    SERVED = ("call", "reserve_new")

    def __init__(self, cfg: TransferQueueConfig, secret: bytes) -> None:
        self._cfg, self._secret = cfg, secret
        self._controller: Controller  # setup() makes it, on the actor's loop
        self._units: list[RpcClient] = []
        self._actors: list[object] = []  # each storage unit's current actor
        self._unit_addresses: list[Address] = []
        self._unit_options: list[dict[str, object]] = []  # what placed each: a replacement is placed alike
        self._replace_timeout_s = REPLACE_TIMEOUT_S
        self._replacing: dict[int, asyncio.Task[None]] = {}
        self._gone: dict[int, str] = {}  # units no replacement is coming for: why

    async def setup(self, units: list[Address], actors: list[object], unit_options: list[dict[str, object]],
                    replace_timeout_s: float) -> Address:
        loop.adopt()  # Ray's loop (uvloop, see loop/) is this process's one loop; the RPC server runs on it
        limits = self._cfg.rpc_limits
        self._units = [RpcClient(a, self._secret, f"TransferQueue storage unit {i}", **limits) for i, a in enumerate(units)]
        self._actors, self._unit_addresses, self._unit_options = list(actors), list(units), list(unit_options)
        self._replace_timeout_s = replace_timeout_s
        self._controller = Controller(self._cfg, free=self._free)
        self._server = RpcServer(self, self.SERVED, self._secret, **limits)
        self._address = await self._server.start(node_address(), self._cfg.ports)
        return self._address

    async def loop_info(self) -> tuple[str, bool]:
        """The class of the loop this actor runs on (``uvloop.Loop``), and whether it is
        this process's asyncrl loop: a diagnostic, called through Ray."""
        return loop.loop_name(), loop.in_loop()

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self._controller, method)(*args)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    async def reserve_new(
        self, partition: str, tags_buf: bytes, indices: list[int], wait: bool, timeout_s: float | None
    ) -> list[int]:
        """``reserve`` + commit of whole new samples at the client's ``indices``; tags as msgpack
        (pickling a list of Structs goes one object at a time: ~10x the bytes' cost)."""
        return await self._controller.reserve(partition, decode_tags(tags_buf), True, wait, timeout_s, indices, True)

    # -- lost storage units (Ray calls: rare, and they carry actor handles) --------------
    async def unit_lost(self, unit: int, generation: int) -> tuple[int, list[UnitState]]:
        """A client found storage unit ``unit``'s actor of ``generation`` dead: its samples
        are dropped (``Controller.unit_lost``) and a replacement starts, once per actor.
        Returns how many were dropped now, and every unit's state."""
        current, _, live = self._controller.unit_state(unit)
        dropped = await self._controller.unit_lost(unit, generation)
        if live and generation == current:  # news: this actor's loss was not reported before
            log.warning("TransferQueue storage unit %d died; %d pending samples it held dropped, a replacement "
                        "is starting", unit, dropped)
            self._replacing[unit] = asyncio.create_task(self._replace(unit), name=f"replace-storage-unit-{unit}")
        return dropped, self.unit_states_now()

    async def unit_states(self, wait: bool = False) -> list[UnitState]:
        """Every unit's state; with ``wait``, once the replacements starting now are in (or given up)."""
        if wait and self._replacing:
            await asyncio.wait(list(self._replacing.values()))  # never cancels them
        return self.unit_states_now()

    def unit_states_now(self) -> list[UnitState]:
        states = []
        for unit, (actor, address) in enumerate(zip(self._actors, self._unit_addresses)):
            generation, first_slot, live = self._controller.unit_state(unit)
            states.append(UnitState(generation=generation, first_slot=first_slot, live=live, actor=actor,
                                    address=address, gone=self._gone.get(unit)))
        return states

    async def _replace(self, unit: int) -> None:
        """A new actor for storage unit ``unit``, placed by the options the lost one had (a
        placement-group bundle waits until Ray placed it again on the nodes left); given
        up, counted in its state, when it does not serve within ``replace_timeout_s``."""
        options = self._unit_options[unit]
        actor = StorageActor.options(**options).remote(unit, self._secret, self._cfg.rpc_limits)  # type: ignore[attr-defined]
        try:
            address = await asyncio.wait_for(unwrap(actor.serve.remote(self._cfg.ports)), self._replace_timeout_s)
            await asyncio.wait_for(unwrap(actor.connect.remote(self._address)), self._replace_timeout_s)
        except Exception as err:  # noqa: BLE001 - isolated on purpose: the queue goes on with the units left
            ray.kill(actor)
            why = (f"no node could hold it within {self._replace_timeout_s:g} s" if isinstance(err, TimeoutError)
                   else f"{type(err).__name__}: {err}".splitlines()[0])
            self._gone[unit] = f"storage unit {unit} was lost and not replaced ({why})"
            log.warning("TransferQueue %s", self._gone[unit])
        else:
            self._units[unit].close()
            self._units[unit] = RpcClient(address, self._secret, f"TransferQueue storage unit {unit}",
                                          **self._cfg.rpc_limits)
            self._actors[unit], self._unit_addresses[unit] = actor, address
            self._controller.unit_replaced(unit)
            log.info("TransferQueue storage unit %d was replaced (%s:%d)", unit, *address)
        finally:
            self._replacing.pop(unit, None)

    async def _free(self, indices: list[int]) -> None:
        # Fire and forget: global indices are never reused, so a late delete can
        # never hit a newer row, and ack need not wait for the storage round trip.
        for unit, (idx, _) in _shard(indices, indices, len(self._units)).items():
            if not self._controller.unit_state(unit)[2]:
                continue  # known lost (its rows with it), no actor yet: nothing to free
            try:
                await self._units[unit].send("delete", idx)
            except ConnectionError:
                pass  # that unit is gone, and its rows with it


async def unwrap(awaitable: Awaitable[T]) -> T:
    """Await a Ray call; an error raised in the actor surfaces as itself, not wrapped."""
    try:
        return await awaitable
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
