"""The Ray deployment: the controller and each storage unit are Ray actors.

    put         client ─put_new(indices, msgpack tags, msgpack rows)─► storage unit u
                        (stores the rows, then) ─reserve_new─► controller   one client call
    put_fields  client ─reserve─► controller;  client ─put_commit(rows)─► storage unit ─commit─► controller
    get         client ─get_batch─► controller (lease);  client ─get(indices)─► each storage unit: one buffer
    ack         client ─ack─► controller ─delete(indices), fire and forget─► storage units

Ray places, starts and kills the actors; the calls above go over direct sockets
(``rpc.py``: a Ray actor call costs ~1 ms of CPU at each end on a small host, a
socket message tens of microseconds). Sample data never passes through the
controller: the client encodes the rows of each write as one msgpack buffer
(``codec.py``: token lists as msgpack arrays, token arrays as their bytes), the
storage unit keeps each new row whole as an unparsed slice of it (the client
sends the row lengths; a row is split into field slices only when fields are
added to it or a read asks for some fields) and answers a read with one buffer,
which the consumer decodes when it reads ``batch.samples`` (or one field of
each, ``batch.column``). Buffers travel out of band: never pickled per token.

A put of new samples is one call from the client: the client takes global
indices from a block the controller allocated to it (``Controller.allocate``)
and sends rows and tags to a storage unit, which stores the rows and then has
the controller register and commit them (the controller alone still decides
capacity, duplicate uids, closed and dead groups). The unit answers once the
controller did, so a put that returns is readable, and a put that raises
registered nothing (its rows are deleted). The controller learns of a row only
after its unit holds it, so a read or a delete never overtakes a row. The client
(a TransferQueue holding actor handles and addresses) pickles, so rollout and
trainer actors in other processes share one queue; each process opens its own
connections.

A unit that dies (its node lost) takes its rows with it:

    client call finds it gone, Ray confirms the actor dead
      ─► ControllerActor.unit_lost: its samples dropped ("storage_lost"), a replacement
         started with the unit's own Ray options (its placement-group bundle, placed
         again by Ray on the nodes left), given up after ``replace_timeout_s``
      ─► that call raises ``StorageUnitLost`` (a put goes on to the next live unit)
    clients learn the replacement lazily: the one whose call fails reports and gets
    every unit's state (``UnitState``); puts ask again at most every ``_RECHECK_S``
    while a unit is down, and wait for a replacement when every unit is down.

A replacement takes new samples only (slots above the lost ones); with none
coming the queue goes on with the units left, and with none left a put raises
``StorageUnitLost`` naming why each is gone.

Ray is imported only when this deployment is chosen, and must already be
initialized: the queue joins the running Ray, it never starts (or stops) one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import ray

import loop
from contracts.placement import node_address
from transfer_queue.coalesce import ReserveRefused
from transfer_queue.codec import decode_raw_row, decode_raw_rows, decode_tags, encode_rows, encode_tags, fields_mask
from transfer_queue.config import RpcLimits, TransferQueueConfig
from transfer_queue.controller import Controller
from transfer_queue.deploy_local import _shard
from transfer_queue.errors import StorageUnitLost
from transfer_queue.rows import EncodedRows
from transfer_queue.rpc import PeerLost, RpcClient, RpcServer, oob
from transfer_queue.storage import StorageUnit
from transfer_queue.wire import QueueStats

__all__ = ["RayDeployment", "UnitState"]

log = logging.getLogger(__name__)

Address = tuple[str, int]

# How long a client waits for Ray to say whether a storage unit it cannot reach is alive.
_ALIVE_CHECK_S = 30.0
# How often a client's puts ask whether a storage unit found dead was replaced.
_RECHECK_S = 1.0
# How long a replacement storage unit may take to be placed and serve, unless create() says.
_REPLACE_TIMEOUT_S = 60.0
# Slots a client takes from the controller at a time (per storage unit), for its puts.
_BLOCK_SLOTS = 1 << 16


class UnitState(msgspec.Struct, frozen=True, kw_only=True):
    """What the controller knows of one storage unit, for a client to route by."""

    generation: int  # actors that served it before this one (replacements so far)
    first_slot: int  # its slots below this were on an actor that died: their rows are gone
    live: bool  # an actor serves it now; False: lost, a replacement starting or given up
    actor: Any  # the Ray actor of this generation
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
        self._controller: RpcClient = None  # type: ignore[assignment]  # made in connect()
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

    async def put_commit(self, indices: list[int], all_indices: list[int], tags: list[Any], buf: bytes) -> None:
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
        self._controller: Controller = None  # type: ignore[assignment]  # made in setup()
        self._units: list[RpcClient] = []
        self._actors: list[Any] = []  # each storage unit's current actor
        self._unit_addresses: list[Address] = []
        self._unit_options: list[dict[str, Any]] = []  # what placed each: a replacement is placed alike
        self._replace_timeout_s = _REPLACE_TIMEOUT_S
        self._replacing: dict[int, asyncio.Task[None]] = {}
        self._gone: dict[int, str] = {}  # units no replacement is coming for: why

    async def setup(self, units: list[Address], actors: list[Any], unit_options: list[dict[str, Any]],
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
        actor = StorageActor.options(**self._unit_options[unit]).remote(  # type: ignore[attr-defined]  # ray.remote
            unit, self._secret, self._cfg.rpc_limits)
        try:
            address = await asyncio.wait_for(_unwrap(actor.serve.remote(self._cfg.ports)), self._replace_timeout_s)
            await asyncio.wait_for(_unwrap(actor.connect.remote(self._address)), self._replace_timeout_s)
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


class RayDeployment:
    """Client side of the Ray deployment: actor handles and addresses only, so it pickles."""

    encoded_put = True  # new samples travel as msgpack bodies (put_new), coalesced

    def __init__(self, controller: Any, units: list[Any], owner: bool, addresses: list[Address], secret: bytes,
                 limits: RpcLimits | None = None, generations: list[int] | None = None) -> None:
        self._controller, self.units, self._owner = controller, list(units), owner
        self._addresses, self._secret, self._limits = list(addresses), secret, RpcLimits(**(limits or {}))
        self._rpc = RpcClient(addresses[0], secret, "the TransferQueue controller", **self._limits)
        self._unit_rpc = [RpcClient(a, secret, f"TransferQueue storage unit {i}", **self._limits)
                          for i, a in enumerate(addresses[1:])]
        self._next_unit = 0
        # What this client knows of each unit's actor (``UnitState``, from the controller when a call failed)
        self._generations = list(generations or [0] * len(self.units))
        self._first_slots = [0] * len(self.units)
        self._down: set[int] = set()  # units with no actor now (found dead; a replacement may be starting)
        self._gone: dict[int, str] = {}  # ... and of those, the ones no replacement is coming for: why
        self._recheck_at = 0.0  # monotonic time a put next asks whether a down unit was replaced
        self._blocks: dict[int, tuple[int, int]] = {}  # unit -> [next, end) of this client's slots

    @classmethod
    async def create(cls, cfg: TransferQueueConfig, unit_options: Sequence[dict[str, Any] | None] = (),
                     controller_options: dict[str, Any] | None = None,
                     replace_timeout_s: float = _REPLACE_TIMEOUT_S) -> RayDeployment:
        """Start the actors. ``unit_options`` (one per storage unit) and ``controller_options``:
        Ray actor options that place them (resources, a placement-group bundle, a node),
        instead of ``cfg.ray_num_cpus`` wherever Ray likes. A unit that dies is replaced with
        its options; ``replace_timeout_s``: how long its replacement may wait to be placed
        (its bundle placed again on the nodes left) before it is given up."""
        if not ray.is_initialized():
            raise RuntimeError("deployment='ray' joins a running Ray; call ray.init(...) first")
        secret = secrets.token_bytes(32)
        default = {"num_cpus": cfg.ray_num_cpus}
        options = [o or default for o in [*unit_options, *[None] * (cfg.num_storage_units - len(unit_options))]]
        # No runtime_env: Ray makes each actor's loop with uvloop already (the loop module says
        # where), and a per-actor runtime_env would cost each one a fresh worker process.
        units = [StorageActor.options(**options[i]).remote(i, secret, cfg.rpc_limits)  # type: ignore[attr-defined]
                 for i in range(cfg.num_storage_units)]
        controller = ControllerActor.options(  # type: ignore[attr-defined]  # a ray.remote class
            **{**default, **(controller_options or {})}).remote(cfg, secret)
        unit_addresses = await _unwrap(asyncio.gather(*(u.serve.remote(cfg.ports) for u in units)))
        address = await _unwrap(controller.setup.remote(unit_addresses, units, options, replace_timeout_s))
        await _unwrap(asyncio.gather(*(u.connect.remote(address) for u in units)))
        return cls(controller, units, True, [address, *unit_addresses], secret, cfg.rpc_limits)

    def __reduce__(self) -> tuple:  # copies never kill the actors
        return (RayDeployment, (self._controller, self.units, False, self._addresses, self._secret, self._limits,
                                self._generations))

    async def call(self, method: str, *args: Any) -> Any:
        return await self._rpc.call("call", method, *args)

    async def put_new(
        self, partition: str, bodies: list[tuple[bytearray, list[int]]], tags: list[Any], wait: bool, timeout_s: float | None
    ) -> list[int]:
        """A put of new samples: one call to the next storage unit (round robin), which
        stores the rows and has the controller register and commit them, at indices
        from this client's own block. ``bodies``: (rows, row ends) from ``codec.encode_new_rows``.

        Returns once they are committed (readable). ``ReserveRefused`` if the
        controller refused (nothing registered, the rows deleted). A unit found dead
        is reported (``_unit_call``) and the put goes to the next live one (or waits
        for a replacement); with none left and none coming it raises ``StorageUnitLost``.
        """
        lengths = []
        for _, ends in bodies:
            lengths += [end - start for start, end in zip([0, *ends], ends)]
        buf = bodies[0][0] if len(bodies) == 1 else b"".join(body for body, _ in bodies)
        while True:
            unit = await self._next_live_unit()
            indices = await self._take_indices(unit, len(tags))
            try:
                return await self._unit_call(
                    unit, "put_new", partition, encode_tags(tags), indices, lengths, wait, timeout_s, oob(buf)
                )
            except StorageUnitLost:
                pass  # reported; the next live unit
            except ReserveRefused as e:
                if not isinstance(e.cause, StorageUnitLost):
                    raise
                self._blocks.pop(unit, None)  # a block of the unit's lost actor: a new one, from its replacement
                await self._refresh()

    async def _next_live_unit(self) -> int:
        """The next unit with an actor (round robin). While one is down and a replacement
        may come, asks the controller (every ``_RECHECK_S``; at once, waiting, when none is up)."""
        if self._down.difference(self._gone):
            if len(self._down) == len(self.units):
                await self._refresh(wait=True)
            elif time.monotonic() >= self._recheck_at:
                await self._refresh()
        for _ in range(len(self.units)):
            unit = self._next_unit
            self._next_unit = (unit + 1) % len(self.units)
            if unit not in self._down:
                return unit
        raise StorageUnitLost(-1, f"every storage unit of this TransferQueue is gone: {'; '.join(self._gone.values())}")

    async def _refresh(self, wait: bool = False) -> None:
        self._adopt(await _unwrap(self._controller.unit_states.remote(wait)))

    def _adopt(self, states: list[UnitState]) -> None:
        """Route by the controller's ``states``: a replaced unit's new actor (this client's
        block of the old one is dropped: its slots are lost), which units are down."""
        for unit, s in enumerate(states):
            if s.generation != self._generations[unit]:
                self._unit_rpc[unit].close()
                self._unit_rpc[unit] = RpcClient(s.address, self._secret, f"TransferQueue storage unit {unit}",
                                                 **self._limits)
                self.units[unit], self._addresses[unit + 1] = s.actor, s.address
                self._generations[unit] = s.generation
                self._blocks.pop(unit, None)
            self._first_slots[unit] = s.first_slot
            if s.live:
                self._down.discard(unit)
            else:
                self._down.add(unit)
            if s.gone is not None:
                self._gone[unit] = s.gone
        self._recheck_at = time.monotonic() + _RECHECK_S

    async def _unit_call(self, unit: int, method: str, *args: Any) -> Any:
        """``method`` on storage unit ``unit``. If the unit's actor is gone, it is reported: the
        controller drops the samples it held (``"storage_lost"``) and replaces it, and this
        raises ``StorageUnitLost``; a unit whose connection broke while Ray still has it alive
        keeps its samples (``PeerLost`` is raised)."""
        # the actor this call goes to: another call may learn of its replacement meanwhile
        rpc, actor, generation = self._unit_rpc[unit], self.units[unit], self._generations[unit]
        try:
            return await rpc.call(method, *args)
        except PeerLost as e:
            if not await self._actor_dead(actor):
                raise  # the actor lives: a broken connection, not lost rows (the next call reconnects)
            dropped, states = await _unwrap(self._controller.unit_lost.remote(unit, generation))
            self._adopt(states)
            raise StorageUnitLost(
                unit, f"TransferQueue storage unit {unit} is gone ({e}); {dropped} pending samples it held were "
                "dropped as 'storage_lost', leased ones are dropped when their lease comes back; "
                + (states[unit].gone or "a replacement takes its new samples")
            ) from None

    async def _call_current(self, unit: int, indices: Sequence[int], method: str, *args: Any) -> Any:
        """``_unit_call`` about rows at ``indices``, again on the unit's new actor when this
        client knew only its lost one and the rows are the new one's (put there since)."""
        generation = self._generations[unit]
        try:
            return await self._unit_call(unit, method, *args)
        except StorageUnitLost:
            n = len(self.units)
            if (self._generations[unit] == generation or unit in self._down
                    or min(indices) // n < self._first_slots[unit]):
                raise
        return await self._unit_call(unit, method, *args)

    @staticmethod
    async def _actor_dead(actor: Any) -> bool:
        """Whether Ray says a storage unit's ``actor`` is dead (so its rows are gone)."""
        try:
            await asyncio.wait_for(actor.num_rows.remote(), _ALIVE_CHECK_S)
        except ray.exceptions.RayActorError:
            return True
        except asyncio.TimeoutError:
            pass  # no answer either way: not known to be dead
        return False

    async def _take_indices(self, unit: int, n: int) -> list[int]:
        """``n`` global indices on ``unit`` from this client's block (a new block when it runs out)."""
        start, end = self._blocks.get(unit, (0, 0))
        if end - start < n:
            size = max(n, _BLOCK_SLOTS)
            start = await self.call("allocate", unit, size)
            end = start + size
        self._blocks[unit] = (start + n, end)
        num_units = len(self.units)
        return [slot * num_units + unit for slot in range(start, start + n)]

    async def write_commit(
        self, indices: Sequence[int], rows: Sequence[dict[str, Any]], all_indices: list[int], tags: list[Any]
    ) -> None:
        shards = _shard(indices, rows, len(self.units))
        if len(shards) == 1:  # the usual case: a put's new samples share one unit
            ((u, (idx, part)),) = shards.items()
            await self._call_current(u, idx, "put_commit", idx, all_indices, tags, oob(encode_rows(part)))
            return
        await asyncio.gather(*(self._call_current(u, idx, "put", idx, oob(encode_rows(part)))
                               for u, (idx, part) in shards.items()))
        await self.call("commit", all_indices, tags)

    async def read(self, indices: Sequence[int], fields: Sequence[str] | None) -> EncodedRows:
        shards = _shard(range(len(indices)), indices, len(self.units), key=indices)
        fields = list(fields) if fields is not None else None
        replies = await asyncio.gather(*(self._call_current(u, idx, "get", idx, fields)
                                         for u, (_, idx) in shards.items()))
        parts = [(positions, buf) for (positions, _), buf in zip(shards.values(), replies)]
        return EncodedRows(len(indices), parts, fields_mask(fields))

    def statistics(self) -> QueueStats:
        return ray.get(self._controller.call.remote("statistics"))

    async def shutdown(self) -> None:
        """Kill the actors (only from the client that created them)."""
        for client in (self._rpc, *self._unit_rpc):
            client.close()
        if self._owner:
            for actor in (self._controller, *self.units):
                ray.kill(actor)


async def _unwrap(awaitable: Any) -> Any:
    """Await a Ray call; an error raised in the actor surfaces as itself, not wrapped."""
    try:
        return await awaitable
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
