"""Joining a Ray cluster (``runtime.address``): the address checked before ``ray.init``.

``ray.init`` retries an address that refuses connections for minutes and waits on
one that accepts but never answers for longer, each ending in a traceback; it
cannot be cancelled once started (its GCS client retries in C++). So the address
is checked first, from this thread, under ``runtime.connect_timeout_s``, leaving
nothing behind when it fails (one socket, closed): ``auto`` resolved as Ray
resolves it, a TCP connection, and the answer a gRPC server (Ray's GCS) gives to
the HTTP/2 preface. An explicit address that answers is then asked for its
cluster id, which says at once whether it is a GCS and whether this process holds
the cluster's token. :class:`~actors.runtime.RayRuntime` joins through
:func:`join_ray_cluster`.
"""

from __future__ import annotations

import os
import socket
import time
import types

__all__ = ["join_ray_cluster"]

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
_H2_SETTINGS = 0x04
_CHECK_PORT = ("check that the head node is up and that this is its GCS address (`ray start --head` prints it; "
               "port 6379 unless --port)")
_CHECK_TOKEN = ("the cluster uses Ray's token authentication: set RAY_AUTH_MODE=token and give this process the "
                "cluster's token (`ray get-auth-token` on the head prints it) in ~/.ray/auth_token, "
                "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")


def join_ray_cluster(ray: types.ModuleType, address: str, timeout_s: float) -> None:
    """``ray.init(address=address)`` after checking, within ``timeout_s``, that a Ray
    cluster answers there; a ``ConnectionError`` of one line naming the address and
    what to check when none does (nothing is started, nothing left running)."""
    target = _resolve_ray_address(address)
    from_env = address == "auto" and bool(os.environ.get("RAY_ADDRESS"))
    label = ("runtime.address" if address != "auto" or target is None else
             f"runtime.address=auto (RAY_ADDRESS={target})" if from_env else
             f"runtime.address=auto (found {target})")
    if target is not None:
        _probe_ray_address(target, timeout_s, label)
        # ray.init turns token auth on by itself (a token file, RAY_AUTH_MODE unset) only for an
        # 'auto' it resolves without RAY_ADDRESS: this check would not see that, ray.init reports it
        if (address != "auto" or from_env) and "://" not in target:
            _check_gcs(target, label)
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as err:  # noqa: BLE001 - whatever Ray raises, the user gets one line naming the address
        try:
            ray.shutdown()  # a half-made connection (ray.init failed midway)
        except Exception:  # noqa: BLE001
            pass
        raise ConnectionError(_join_failed(label, target or address, err)) from None


def _resolve_ray_address(address: str) -> str | None:
    """The ``host:port`` (or ``ray://host:port``) that ``ray.init(address=address)``
    would join; ``None`` when it cannot be told here (another Ray version: ray.init
    decides). ``auto`` with no cluster to join is a ``ConnectionError``: Ray would
    raise one too; with ``RAY_ADDRESS=local`` Ray would start a cluster instead."""
    if address != "auto":
        return address
    try:  # Ray's private API (another version may lack it: then ray.init decides); ~0.75 s to import
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return None
    env = os.environ.get("RAY_ADDRESS") or None
    if env == "local":
        raise ConnectionError("runtime.address=auto: RAY_ADDRESS=local asks Ray to start a new cluster, not to join "
                              "one; set RAY_ADDRESS to the head's host:port or unset it (or leave runtime.address "
                              "unset to start a cluster for this run)")
    try:
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:
        raise ConnectionError("runtime.address=auto: no running Ray cluster found on this machine (RAY_ADDRESS is "
                              "unset and no Ray node runs here); start one with `ray start --head`, set "
                              "runtime.address to the head's host:port, or leave runtime.address unset to start "
                              "a cluster for this run") from None


def _probe_ray_address(address: str, timeout_s: float, label: str = "runtime.address") -> None:
    """``ConnectionError`` naming ``address`` unless something there accepts a TCP
    connection and answers the HTTP/2 preface as a gRPC server does (Ray's GCS, or
    the Ray Client server for ``ray://``), all within ``timeout_s``. With Ray's TLS
    on (``RAY_USE_TLS``) only the connection is checked."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return  # not host:port: ray.init says what is wrong with it
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except TimeoutError:
        raise ConnectionError(f"{label}: no Ray cluster answers at {address} (no connection within {timeout_s:g} s, "
                              f"runtime.connect_timeout_s); check the host name and that no firewall drops the port; "
                              f"{_CHECK_PORT}") from None
    except OSError as err:
        raise ConnectionError(f"{label}: no Ray cluster answers at {address} "
                              f"({err.strerror or type(err).__name__}); {_CHECK_PORT}") from None
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
                head += chunk
        except TimeoutError:
            raise ConnectionError(f"{label}: {address} accepted a connection but did not answer within {timeout_s:g} s "
                                  f"(runtime.connect_timeout_s); {_CHECK_PORT}, and not another service's "
                                  f"or an overloaded head's") from None
        except OSError as err:
            head = f"({err.strerror or type(err).__name__})".encode()
    if len(head) < 9 or head[3] != _H2_SETTINGS:
        what = "closed the connection" if not head else f"answered {head[:9]!r}"
        raise ConnectionError(f"{label}: something listens at {address} but it is not a Ray cluster (it {what}, "
                              f"not as Ray's gRPC); {_CHECK_PORT}")


def _check_gcs(address: str, label: str) -> None:
    """Ask the GCS at ``address`` (which answered the probe) for its cluster id, as
    ``ray.init`` does first: a refused token or a gRPC server that is not a GCS is
    one line now (``ray.init`` would retry it for a while and then name neither)."""
    try:  # Ray's private API (another version may lack it: then ray.init reports it); ~0.75 s to import
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError, RpcError
    except ImportError:
        return
    try:
        GcsClient(address=address)
    except AuthenticationError:
        raise ConnectionError(f"{label}: the Ray cluster at {address} refused this process's token (none or "
                              f"another); {_CHECK_TOKEN}") from None
    except RpcError as err:
        if "not found" in str(err).lower() or "unimplemented" in str(err).lower():
            raise ConnectionError(f"{label}: {address} answers gRPC but is not a Ray GCS (a Ray Client port? join "
                                  f"that as ray://{address}); {_CHECK_PORT}") from None
    except Exception:  # noqa: BLE001 - ray.init tries again and reports it
        pass


def _join_failed(label: str, address: str, err: BaseException) -> str:
    """One line for a ``ray.init`` that failed after the checks."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " ".join(" ".join(f"{type(e).__name__}: {e}" for e in chain).split())
    if any(type(e).__name__ == "AuthenticationError" for e in chain) or "InvalidAuthToken" in text:
        return f"{label}: the Ray cluster at {address} refused this process's token (none or another); {_CHECK_TOKEN}"
    first = " ".join(str(err).split()) or type(err).__name__
    return f"{label}: joining the Ray cluster at {address} failed ({type(err).__name__}: {first[:300]}); {_CHECK_PORT}"
