"""The ``local`` deployment served to other processes: controller and storage
units in one process (a queue-host actor), clients anywhere on its sockets.

    rollout actor ─put_new (msgpack rows: one call)──►  QueueHost  ◄─get / ack─ trainer actor
    driver        ─statistics, close───────────────►   (LocalDeployment behind ``rpc.py``)

Under the ``process`` and ``ray`` runtimes the actors live in processes of
their own, so a queue inside the driver would make the driver carry every
sample. The composition root spawns a :class:`QueueHost` as an actor of the
runtime instead and hands a :class:`ServedDeployment` client (address and
secret: it pickles) to every actor; the driver keeps one for control calls.
New samples travel as one msgpack body (``codec.encode_new_rows``: a token array as its
bytes), decoded, registered, stored and committed by the host in one call; other rows
(``put_fields``, reads) as pickles with their numpy token arrays out of band.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from contracts.placement import node_address
from transfer_queue.codec import decode_new_rows
from transfer_queue.config import RpcLimits, TransferQueueConfig
from transfer_queue.deploy_local import LocalDeployment
from transfer_queue.rows import InProcessRows
from transfer_queue.rpc import RpcClient, RpcServer
from transfer_queue.wire import QueueStats, SampleTags

__all__ = ["QueueHost", "ServedDeployment", "new_secret"]

Address = tuple[str, int]


def new_secret() -> bytes:
    return secrets.token_bytes(32)


class QueueHost:
    """An actor (any runtime): a :class:`LocalDeployment` served over a socket.
    ``host``: the address to listen on (None: this node's address)."""

    SERVED = ("call", "put_new", "write_commit", "read")

    def __init__(self, cfg: TransferQueueConfig, secret: bytes, host: str | None = None) -> None:
        self._cfg, self._secret, self._host = cfg, secret, host
        self._d: LocalDeployment = None  # type: ignore[assignment]  # made in setup()
        self._server: RpcServer | None = None
        self._address: Address | None = None

    async def setup(self) -> None:
        self._d = LocalDeployment(self._cfg)
        self._server = RpcServer(self, self.SERVED, self._secret, **self._cfg.rpc_limits)
        self._address = await self._server.start(self._host or node_address(), self._cfg.ports)

    async def address(self) -> Address:
        assert self._address is not None, "setup() was not awaited"
        return self._address

    async def call(self, method: str, *args: Any) -> Any:
        return await self._d.call(method, *args)

    async def write_commit(self, indices: list[int], rows: list[dict[str, Any]], all_indices: list[int],
                           tags: list[SampleTags]) -> None:
        await self._d.write_commit(indices, rows, all_indices, tags)

    async def put_new(self, partition: str, body: bytes, ends: list[int], tags: list[SampleTags], wait: bool,
                      timeout_s: float | None) -> list[int]:
        """New samples, whole: their rows as ``codec.encode_new_rows`` wrote them, decoded here,
        registered, stored and committed; the indices (-1: dropped on arrival)."""
        return await self._d.put_new(partition, decode_new_rows(body, ends), tags, wait, timeout_s)

    async def read(self, indices: list[int], fields: Sequence[str] | None) -> list[dict[str, Any]]:
        return (await self._d.read(indices, fields))._rows

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
        if self._d is not None:
            await self._d.shutdown()


class ServedDeployment:
    """Client side of a :class:`QueueHost`: its address, secret and the socket
    transport's bounds (``TransferQueueConfig.rpc_limits``) only, so it pickles."""

    encoded_put = True  # new samples travel as one msgpack body, in one call (put_new)

    def __init__(self, address: Address, secret: bytes, limits: RpcLimits | None = None) -> None:
        self._address: Address = (address[0], address[1])
        self._secret, self._limits = secret, RpcLimits(**(limits or {}))
        self._rpc = RpcClient(self._address, secret, "the TransferQueue host", **self._limits)

    def __reduce__(self) -> tuple:
        return (ServedDeployment, (self._address, self._secret, self._limits))

    async def call(self, method: str, *args: Any) -> Any:
        return await self._rpc.call("call", method, *args)

    async def put_new(self, partition: str, bodies: list[tuple[bytearray, list[int]]], tags: list[SampleTags],
                      wait: bool, timeout_s: float | None) -> list[int]:
        """A put of new samples in one round trip: ``bodies``, as ``RayDeployment.put_new``
        takes them, is one (rows, row ends) from ``codec.encode_new_rows`` (a served queue's
        puts are not coalesced). ``ReserveRefused`` if the controller refused (nothing registered)."""
        [(body, ends)] = bodies
        return await self._rpc.call("put_new", partition, body, ends, tags, wait, timeout_s)

    async def write_commit(self, indices: Sequence[int], rows: Sequence[dict[str, Any]], all_indices: list[int],
                           tags: list[SampleTags]) -> None:
        await self._rpc.call("write_commit", list(indices), list(rows), all_indices, tags)

    async def read(self, indices: Sequence[int], fields: Sequence[str] | None) -> InProcessRows:
        return InProcessRows(await self._rpc.call("read", list(indices), None if fields is None else list(fields)))

    def statistics(self) -> QueueStats:
        raise RuntimeError("a served TransferQueue answers statistics over its socket: use statistics_async()")

    async def shutdown(self) -> None:
        """Close this client's connection (the host is an actor: its runtime ends it)."""
        self._rpc.close()

