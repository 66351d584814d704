"""A probe of what crosses the driver process's boundaries, for
``tests/test_direct_paths.py``: every message the driver writes to or reads
from an actor or the TransferQueue, and the sample and weight payload bytes
inside it.

It hooks the serialization boundaries, where a message becomes the bytes the
driver writes (and bytes read become a message), so it sees each message as
objects (before encoding, after decoding) together with its bytes on the wire,
whichever code path sent it:

    runtime ``process``  actors/runtime/process.py's ``pickle``: ``dumps`` of every call,
                         ``loads`` of every reply (the only codec of the actors'
                         pipes), attributed by ``_ProcessHandle._send`` and
                         ``_read``; ``ProcessRuntime.spawn`` for the constructor's
                         arguments (multiprocessing pickles those at the start)
    TransferQueue wire   transfer_queue/rpc.py's ``_frame`` (every message
                         encoded: its pickle and out-of-band buffers) and
                         ``_read_frame`` (every message decoded), attributed by
                         ``RpcClient._write`` and ``_Connection``
    runtime ``ray``      Ray's ``SerializationContext.serialize`` (every value the
                         driver hands Ray) and ``deserialize_objects`` (every
                         result it takes: ``await ref``, ``ray.get``), attributed
                         by ``ActorMethod._remote`` and ``ActorClass._remote``
                         (every ``.remote()`` call and actor creation)
    runtime ``local``    ``_LocalHandle.call`` and ``LocalRuntime.spawn``: nothing
                         is encoded there (arguments cross by reference), so what
                         it sees is what the policy holds

Every message is measured by kind (:func:`measure`): the payload kinds, none of
which may cross the driver (a sample's token arrays, weights, raw buffers), and
the control kinds every control message is made of (numbers, short number
lists, strings as values and as names, small byte chunks, a weight manifest's
contents, a group request's prompt). :class:`DriverProbe` keeps both, by where
each message crossed, with what ``tests/control_budget.py`` allows each one:
the direct-path tests check the payload is zero and the control within budget.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import pickle
import threading
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from actors.runtime import local as rt_local, process as rt_process
from contracts.rollout import GenerateOutput, GroupRequest
from contracts.sample import TOKEN_DTYPES, Sample
from contracts.weights import Manifest, WeightUpdate
from transfer_queue import rpc
from transfer_queue.codec import ALL_FIELDS

__all__ = ["BUFFER", "CONTROL_KINDS", "MANIFEST", "NAME", "NUMBER", "PAYLOAD_KINDS", "PROMPT", "SAMPLE",
           "SHORT_LIST", "SMALL_BYTES", "TEXT", "UNMEASURED", "WEIGHT", "DriverProbe", "Seen", "install", "measure",
           "payload", "payload_bytes"]

# Payload: none of it may cross the driver.
SAMPLE = "sample"  # a Sample, a queue row, token ids, log-probs
WEIGHT = "weight"  # a tensor, a weight update's buckets
BUFFER = "buffer"  # raw bytes, an array or a PickleBuffer that is neither of the above by where it sits
UNMEASURED = "unmeasured"  # a message too deep or too big to walk: it counts, so nothing passes unseen
PAYLOAD_KINDS = (SAMPLE, WEIGHT, BUFFER, UNMEASURED)
# Control: what control messages are made of, each kind budgeted by tests/control_budget.py. The
# content only, as the values pickle would write (a field's name is its type's, not the message's;
# None and empty containers count zero): a number is 8 bytes, the int64 / float64 it would be.
NUMBER = "number"  # a number on its own: a field, a dict value, an item of a mixed list
SHORT_LIST = "short list"  # the numbers of a list or tuple of numbers only, at most TOKEN_LIST_MAX_CONTROL
TEXT = "text"  # a string value (a group id, an error message): its UTF-8 bytes
NAME = "name"  # a string dict key (a metric's, a drop reason's, a keyword argument's name): its UTF-8 bytes
SMALL_BYTES = "small bytes"  # small bytes-like chunks (a secret, a digest) within SMALL_CHUNKS_MAX_CONTROL
MANIFEST = "manifest"  # all a weight manifest says (tensor names, shapes, sizes, checksums), in bytes as above
PROMPT = "prompt"  # a group request's prompt ids and meta: the request itself (DESIGN.md), not a sample
CONTROL_KINDS = (NUMBER, SHORT_LIST, TEXT, NAME, SMALL_BYTES, MANIFEST, PROMPT)

# A list or tuple of more than this many numbers is a token sequence (ids, log-probs,
# versions): control lists through the driver are a few numbers (a shape, a checksum
# pair, counts), a response or a prompt worth training on is longer. Shorter token
# lists of a real sample still count: inside a Sample or a queue row every number list
# does. A weight manifest's lists (bucket sizes, one per bucket) are not tokens.
TOKEN_LIST_MAX_CONTROL = 16
_BYTES_PER_NUMBER = 8  # a number's bytes, as the int64 / float64 it would be
# A bytes-like object of at most this many bytes is a small chunk: alone it is a
# secret, a nonce or a digest (32 bytes), not payload. Small chunks add up per message,
# and count once their total is over SMALL_CHUNKS_MAX_CONTROL, so payload split into
# many pieces (100 chunks of 40 bytes) does not pass while the queue's 32-byte secret,
# handed to actors in a client, does.
SMALL_CHUNK_BYTES = 64
SMALL_CHUNKS_MAX_CONTROL = 256
_MAX_DEPTH, _MAX_NODES = 40, 200_000
_SAMPLE_TYPES = (Sample, GenerateOutput)
_OUTPUT_TOKENS = ("token_ids", "logprobs", "raw_logprobs")  # GenerateOutput's token fields
_REFERENCES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
               types.CodeType)  # pickled by name: they carry no data
_NUMBERS = (bool, int, float, complex, np.number, np.bool_)


def measure(obj: Any) -> Counter[str]:
    """The bytes inside ``obj`` (one message) by kind: payload (PAYLOAD_KINDS) and
    control (CONTROL_KINDS)."""
    m = _Measure()
    m.walk(obj, None, 0)
    return m.result()


def payload(obj: Any) -> Counter[str]:
    """Payload bytes inside ``obj`` (one message), by kind (SAMPLE, WEIGHT, BUFFER,
    UNMEASURED); empty for a control message."""
    return Counter({k: n for k, n in measure(obj).items() if k in PAYLOAD_KINDS})


def payload_bytes(obj: Any) -> int:
    """All payload bytes inside ``obj``, whatever their kind."""
    return sum(payload(obj).values())


def _is_numbers(seq: list | tuple) -> bool:
    return all(isinstance(x, _NUMBERS) and not isinstance(x, bool) for x in seq)


def _is_row(d: dict) -> bool:
    """A TransferQueue row: one sample's fields by name (transfer_queue/codec.py)."""
    return isinstance(d.get("uid"), str) and "group_id" in d and any(k in ALL_FIELDS for k in d)


def _is_ray_reference(obj: Any) -> bool:
    """Ray's ObjectRef and ActorHandle name data or an actor, they do not carry it
    (and their reduce has side effects on Ray's reference counts)."""
    return type(obj).__module__.startswith("ray.") and type(obj).__name__ in ("ObjectRef", "ActorHandle")


class _Measure:
    """One walk over one message, following what pickle would write. ``ctx`` is
    what the walk is inside: a sample or a weight (payload: what it holds is that
    payload's), a manifest or a prompt (what it holds counts as that kind)."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.small: Counter[str] = Counter()  # small chunks, by the payload kind they are when they add up
        self.seen: set[int] = set()  # pickle writes a shared object once: it counts once
        self.num_nodes = 0

    def result(self) -> Counter[str]:
        if sum(self.small.values()) > SMALL_CHUNKS_MAX_CONTROL:
            self.bytes.update(self.small)
        else:
            self.bytes[SMALL_BYTES] += sum(self.small.values())
        return +self.bytes

    def _chunk(self, nbytes: int, kind: str) -> None:
        if nbytes > SMALL_CHUNK_BYTES:
            self.bytes[kind] += nbytes
        elif nbytes:
            self.small[kind] += nbytes

    def _control(self, kind: str, nbytes: int, ctx: str | None) -> None:
        """Control content of ``nbytes``: ``kind``, or the manifest's or prompt's it
        is part of; inside a sample or a weight it is already counted as that payload."""
        if ctx not in (SAMPLE, WEIGHT):
            self.bytes[ctx if ctx in (MANIFEST, PROMPT) else kind] += nbytes

    def walk(self, obj: Any, ctx: str | None, depth: int, key: bool = False) -> None:
        if obj is None:
            return
        if isinstance(obj, str):  # a dict key is a name; every occurrence counts (pickle memoizes some)
            self._control(NAME if key else TEXT, len(obj.encode("utf-8", "surrogatepass")), ctx)
            return
        if isinstance(obj, _NUMBERS):
            self._control(NUMBER, _BYTES_PER_NUMBER, ctx)
            return
        if depth > _MAX_DEPTH or self.num_nodes > _MAX_NODES:
            self.bytes[UNMEASURED] += 1
            return
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.num_nodes += 1
        kind = ctx if ctx in (SAMPLE, WEIGHT) else WEIGHT if ctx == MANIFEST else None
        down = depth + 1
        if isinstance(obj, _SAMPLE_TYPES):
            tokens = [f for f in obj.__struct_fields__ if f in TOKEN_DTYPES or f in _OUTPUT_TOKENS]
            self.bytes[SAMPLE] += max(1, sum(np.asarray(getattr(obj, f)).nbytes for f in tokens))
            for f in obj.__struct_fields__:
                if f not in tokens:
                    self.walk(getattr(obj, f), SAMPLE, down)
        elif isinstance(obj, GroupRequest):
            # The prompt the policy hands a rollout actor is a group request's content, control
            # by the design (DESIGN.md: the driver carries group requests); what comes back of a
            # sample (response, log-probs, versions) is payload.
            for f in obj.__struct_fields__:
                self.walk(getattr(obj, f), PROMPT if f in ("prompt_ids", "meta") and ctx is None else ctx, down)
        elif isinstance(obj, (Manifest, WeightUpdate)):
            for f in obj.__struct_fields__:
                self.walk(getattr(obj, f), WEIGHT if f == "buckets" else MANIFEST, down)
        elif isinstance(obj, torch.Tensor):
            self.bytes[kind or WEIGHT] += max(1, obj.numel() * obj.element_size())
        elif isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                for x in obj.flat:
                    self.walk(x, ctx, down)
            else:
                self.bytes[kind or BUFFER] += max(1, obj.nbytes)
        elif isinstance(obj, pickle.PickleBuffer):
            self._chunk(obj.raw().nbytes, kind or BUFFER)
        elif isinstance(obj, (bytes, bytearray, memoryview, array.array)):
            self._chunk(memoryview(obj).nbytes, kind or BUFFER)
        elif isinstance(obj, dict):
            if _is_row(obj):
                ctx = SAMPLE
                self.bytes[SAMPLE] += 1  # a row is a sample, even one of scalar fields only
            for k, v in obj.items():
                self.walk(k, ctx, down, key=True)
                self.walk(v, ctx, down)
        elif isinstance(obj, (list, tuple)):
            self._walk_sequence(obj, ctx, down)
        elif isinstance(obj, (set, frozenset, collections.deque)):
            for x in obj:
                self.walk(x, ctx, down)
        elif isinstance(obj, msgspec.Struct):
            for f in obj.__struct_fields__:
                self.walk(getattr(obj, f), ctx, down)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                self.walk(getattr(obj, f.name, None), ctx, down)
        elif isinstance(obj, _REFERENCES) or _is_ray_reference(obj):
            return
        else:
            self._walk_object(obj, ctx, down)

    def _walk_sequence(self, obj: list | tuple, ctx: str | None, depth: int) -> None:
        """A list or tuple of numbers only is a token sequence when long or inside a
        sample, else a short list; any other's items are walked one by one."""
        if not obj or not _is_numbers(obj):
            for x in obj:
                self.walk(x, ctx, depth)
        elif ctx not in (MANIFEST, PROMPT) and (ctx == SAMPLE or len(obj) > TOKEN_LIST_MAX_CONTROL):
            self.bytes[SAMPLE] += _BYTES_PER_NUMBER * len(obj)
        else:
            self._control(SHORT_LIST, _BYTES_PER_NUMBER * len(obj), ctx)

    def _walk_object(self, obj: Any, ctx: str | None, depth: int) -> None:
        """Any other object as pickle would write it (its reduce: arguments, state,
        items); one that does not pickle (it can cross only by reference, under the
        ``local`` runtime) by its ``__dict__`` and ``__slots__``."""
        try:
            reduced = obj.__reduce_ex__(5)
        except Exception:  # noqa: BLE001 - unpicklable: read its attributes
            reduced = None
        if isinstance(reduced, str):  # a global, pickled by name
            return
        if isinstance(reduced, tuple):
            for part in reduced[1:3]:
                self.walk(part, ctx, depth)
            for items in reduced[3:5]:
                if items is not None:
                    self.walk(list(items), ctx, depth)
            return
        self.walk(getattr(obj, "__dict__", None), ctx, depth)
        for cls in type(obj).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    self.walk(getattr(obj, name, None), ctx, depth)


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a probe counted up to a moment: messages by where they crossed,
    wire bytes by boundary, and by (where, kind): payload bytes, control bytes,
    and the control bytes the budget allowed those messages."""

    messages: Counter[str]
    wire_bytes: Counter[str]
    payload: Counter[tuple[str, str]]
    control: Counter[tuple[str, str]]
    allowed: Counter[tuple[str, str]]

    def __sub__(self, before: Seen) -> Seen:
        return Seen(self.messages - before.messages, self.wire_bytes - before.wire_bytes,
                    self.payload - before.payload, self.control - before.control, self.allowed - before.allowed)

    def bytes_of(self, kind: str) -> dict[str, int]:
        """Bytes of ``kind`` (payload or control), by where they crossed."""
        counts = self.payload if kind in PAYLOAD_KINDS else self.control
        return {where: n for (where, k), n in counts.items() if k == kind}

    def over_budget(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(where, kind) -> (control bytes seen, bytes allowed) wherever they are
        more than the budget allowed the same messages. Judged where they crossed,
        not summed over the driver: room one endpoint has left (a step report's
        metric names) hides nothing at another (a string in a group report)."""
        return {wk: (n, self.allowed[wk]) for wk, n in sorted(self.control.items()) if n > self.allowed[wk]}


class DriverProbe:
    """Counts the driver's messages and the bytes inside them by kind, and what
    ``budget(where, message)`` allows each (thread-safe: the ``process`` runtime
    reads replies on a thread per actor, Ray on its own). Without a budget
    (``None``: until the run's is known) nothing is allowed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: Counter[str] = Counter()
        self._wire_bytes: Counter[str] = Counter()
        self._payload: Counter[tuple[str, str]] = Counter()
        self._control: Counter[tuple[str, str]] = Counter()
        self._allowed: Counter[tuple[str, str]] = Counter()
        self.budget: Callable[[str, Any], Counter[str]] | None = None
        self._local = threading.local()
        self._where: dict[tuple[int, Any], str] = {}  # (connection or handle, call id) -> where its call went
        self._readers: dict[int, Any] = {}  # id of an rpc reader -> its connection

    def see(self, where: str, obj: Any, boundary: str | None = None, wire_bytes: int = 0) -> None:
        found = measure(obj)
        allowed = self.budget(where, obj) if self.budget is not None else Counter()
        with self._lock:
            self._messages[where] += 1
            if boundary is not None:
                self._wire_bytes[boundary] += wire_bytes
            for kind, n in found.items():
                (self._payload if kind in PAYLOAD_KINDS else self._control)[where, kind] += n
            for kind, n in allowed.items():
                self._allowed[where, kind] += n

    def snapshot(self) -> Seen:
        with self._lock:
            return Seen(Counter(self._messages), Counter(self._wire_bytes), Counter(self._payload),
                        Counter(self._control), Counter(self._allowed))

    # ------------------------------------------------------------ runtime 'process'
    def _pickle_dumps(self, obj: Any, *args: Any, **kwargs: Any) -> bytes:
        data = pickle.dumps(obj, *args, **kwargs)
        handle = getattr(self._local, "sending", None)
        if handle is not None and isinstance(obj, tuple) and len(obj) == 4:
            call_id, method, call_args, call_kwargs = obj
            where = self._where[id(handle), call_id] = f"process:{handle.name}.{method}"
            self.see(f"{where} (sent)", (call_args, call_kwargs), "pipe", len(data))
        else:
            self.see("process:unattributed (sent)", obj, "pipe", len(data))
        return data

    def _pickle_loads(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        handle = getattr(self._local, "reading", None)
        if handle is None:
            value = pickle.loads(data, *args, **kwargs)
            self.see("process:unattributed (received)", value, "pipe", len(data))
            return value
        if self._local.outer:  # the reply's frame: (call id, ok, the reply's own pickle)
            self._local.outer = False
            value = pickle.loads(data, *args, **kwargs)
            self._local.call_id = value[0]
            with self._lock:
                self._wire_bytes["pipe"] += len(data)
            return value
        self._local.outer = True  # first: the reply may not unpickle here
        value = pickle.loads(data, *args, **kwargs)
        where = self._where.pop((id(handle), self._local.call_id), f"process:{handle.name}.?")
        self.see(f"{where} (received)", value)  # its bytes counted with its frame
        return value

    # -------------------------------------------------------- the TransferQueue wire
    @staticmethod
    def _rpc_where(message: tuple) -> tuple[str, Any]:
        rid, what, body = message
        if isinstance(what, str):  # a call: (id, method, args)
            if what == "call" and body and isinstance(body[0], str):  # a served queue's controller call
                what = f"call.{body[0]}"
            return f"queue:{what}", body
        return "queue:reply", body  # an answer: (id, ok, value), written by a server in this process


def install(monkeypatch: pytest.MonkeyPatch) -> DriverProbe:
    """Hook every boundary of the driver (module docstring); ``monkeypatch`` undoes it."""
    p = DriverProbe()
    _install_local(p, monkeypatch)
    _install_process(p, monkeypatch)
    _install_queue_wire(p, monkeypatch)
    try:
        import ray  # noqa: F401
    except ImportError:
        return p
    _install_ray(p, monkeypatch)
    return p


def _seen_spawn(p: DriverProbe, spawn: Any, runtime: str) -> Any:
    """A runtime's ``spawn`` that shows the constructor's arguments as one message."""

    async def spawning(self: Any, cls: type, *args: Any, name: str, **kwargs: Any) -> Any:
        p.see(f"{runtime}:{name}.__init__ (sent)", (args, kwargs))
        return await spawn(self, cls, *args, name=name, **kwargs)

    return spawning


def _install_local(p: DriverProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtime ``local``: a call is a coroutine on the driver's loop; nothing is encoded."""
    local_call = rt_local._LocalHandle.call

    async def call_local(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        where = f"local:{self.name}.{method}"
        p.see(f"{where} (sent)", (args, kwargs))
        result = await local_call(self, method, *args, **kwargs)
        p.see(f"{where} (received)", result)
        return result

    monkeypatch.setattr(rt_local._LocalHandle, "call", call_local)
    monkeypatch.setattr(rt_local.LocalRuntime, "spawn", _seen_spawn(p, rt_local.LocalRuntime.spawn, "local"))


def _install_process(p: DriverProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtime ``process``: actors/runtime/process.py encodes every call and decodes every reply
    with its module's pickle; ``_send`` (loop thread) and ``_read`` (one thread per
    actor) say whose. The constructor's arguments travel in the child's start
    (multiprocessing pickles them): ``spawn`` shows them."""
    send, read = rt_process._ProcessHandle._send, rt_process._ProcessHandle._read

    def sending(self: Any, *args: Any) -> None:
        p._local.sending = self
        try:
            send(self, *args)
        finally:
            p._local.sending = None

    def reading(self: Any) -> None:
        p._local.reading, p._local.outer = self, True
        read(self)

    monkeypatch.setattr(rt_process.ProcessRuntime, "spawn", _seen_spawn(p, rt_process.ProcessRuntime.spawn, "process"))
    monkeypatch.setattr(rt_process._ProcessHandle, "_send", sending)
    monkeypatch.setattr(rt_process._ProcessHandle, "_read", reading)
    codec = {k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")}
    monkeypatch.setattr(rt_process, "pickle", types.SimpleNamespace(**{**codec, "dumps": p._pickle_dumps,
                                                               "loads": p._pickle_loads}))


class _CountingReader:
    """A stream reader that counts the bytes read through it."""

    def __init__(self, reader: Any) -> None:
        self.reader, self.nbytes = reader, 0

    async def readexactly(self, n: int) -> bytes:
        data = await self.reader.readexactly(n)
        self.nbytes += len(data)
        return data


def _install_queue_wire(p: DriverProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TransferQueue's socket wire (the served local deployment and the ray one):
    ``_frame`` and ``_read_frame`` see every message, ``RpcClient._write`` and
    ``_Connection`` say whose call a reply answers."""
    frame, read_frame = rpc._frame, rpc._read_frame
    connection_init, write = rpc._Connection.__init__, rpc.RpcClient._write

    def framed(obj: Any, max_bytes: int) -> list[Any]:
        parts = frame(obj, max_bytes)
        where, body = p._rpc_where(obj)
        p.see(f"{where} (sent)", body, "socket", sum(memoryview(x).nbytes for x in parts))
        return parts

    async def read_framed(reader: Any, max_bytes: int) -> Any:
        counting = _CountingReader(reader)
        message = await read_frame(counting, max_bytes)
        conn = p._readers.get(id(reader))
        where, body = p._rpc_where(message)
        if conn is not None:  # a reply to a call of this process's client
            where = p._where.pop((id(conn), message[0]), "queue:?")
        p.see(f"{where} (received)", body, "socket", counting.nbytes)
        return message

    def connected(self: Any, reader: Any, *args: Any, **kwargs: Any) -> None:
        p._readers[id(reader)] = self
        connection_init(self, reader, *args, **kwargs)

    async def writing(self: Any, conn: Any, message: tuple) -> None:
        p._where[id(conn), message[0]] = p._rpc_where(message)[0]
        await write(self, conn, message)

    monkeypatch.setattr(rpc, "_frame", framed)
    monkeypatch.setattr(rpc, "_read_frame", read_framed)
    monkeypatch.setattr(rpc._Connection, "__init__", connected)
    monkeypatch.setattr(rpc.RpcClient, "_write", writing)


def _install_ray(p: DriverProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's serialization boundary in the driver. Every ``.remote()`` call of an
    actor method (``_RayHandle.call``, the runtime's direct ``setup``/``close``, the
    ray TransferQueue's control calls) goes through ``ActorMethod._remote``, every
    actor's creation through ``ActorClass._remote``; both serialize the arguments
    on the calling thread. Every result the driver takes (``await ref``,
    ``ray.get``) is deserialized by ``deserialize_objects``."""
    from ray import actor as ray_actor
    from ray._private import serialization

    serialize = serialization.SerializationContext.serialize
    deserialize = serialization.SerializationContext.deserialize_objects

    def attributed(submit: Any, where_of: Any) -> Any:
        """``submit`` (an ``_remote``: arguments serialized on this thread) seen as one message."""

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            call_args = kwargs.get("args", args[0] if args else None)
            call_kwargs = kwargs.get("kwargs", args[1] if len(args) > 1 else None)
            where = where_of(self)
            p._local.ray_call = [0]  # the bytes its arguments serialize to
            try:
                refs = submit(self, *args, **kwargs)
            finally:
                wire, p._local.ray_call = p._local.ray_call, None
            p.see(f"{where} (sent)", (call_args, call_kwargs), "ray", wire[0])
            for ref in refs if isinstance(refs, list) else [refs]:
                if type(ref).__name__ == "ObjectRef":
                    p._where[id(p), ref.hex()] = where
            return refs

        return call

    def method(self: Any) -> str:
        actor = getattr(getattr(self._actor, "_ray_actor_creation_function_descriptor", None), "class_name", "?")
        return f"ray:{actor}.{self._method_name}"

    def serialized(self: Any, value: Any) -> Any:
        out = serialize(self, value)
        nbytes = int(getattr(out, "total_bytes", 0))
        call = getattr(p._local, "ray_call", None)
        if call is not None:  # an argument of the call being made on this thread
            call[0] += nbytes
        else:  # a value handed to Ray outside an actor call: ray.put
            p.see("ray:put (sent)", value, "ray", nbytes)
        return out

    def deserialized(self: Any, objects: Any, refs: Any, *args: Any, **kwargs: Any) -> Any:
        values = deserialize(self, objects, refs, *args, **kwargs)
        for item, ref, value in zip(objects, refs, values):
            data = item[0]
            where = p._where.pop((id(p), ref.hex()), "ray:get") if ref is not None else "ray:get"
            p.see(f"{where} (received)", value, "ray", len(data) if data is not None else 0)
        return values

    monkeypatch.setattr(ray_actor.ActorMethod, "_remote", attributed(ray_actor.ActorMethod._remote, method))
    monkeypatch.setattr(ray_actor.ActorClass, "_remote", attributed(
        ray_actor.ActorClass._remote, lambda cls: f"ray:{cls.__ray_metadata__.class_name}.__init__"))
    monkeypatch.setattr(serialization.SerializationContext, "serialize", serialized)
    monkeypatch.setattr(serialization.SerializationContext, "deserialize_objects", deserialized)
