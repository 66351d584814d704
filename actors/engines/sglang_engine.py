"""The SGLang rollout engine: the engine protocol over an SGLang server's native
HTTP API (extra ``sglang`` to launch one; a server at ``rollout.engine.url``
needs no SGLang package here: this module speaks HTTP/1.1 itself).

    protocol                 SGLang (request/response schemas: python/sglang/srt/managers/io_struct.py,
                             routes: python/sglang/srt/entrypoints/http_server.py)
    setup                    GET /get_model_info on the server at ``url``; without one, launch
                             ``python -m sglang.launch_server`` on a free loopback port, wait for GET /health
    stream / generate        POST /generate {rid, input_ids, sampling_params, return_logprob: true,
                             logprob_start_len: -1, stream: true}: server-sent events ("data: {json}",
                             last "data: [DONE]"), each with the cumulative output_ids and
                             meta_info.output_token_logprobs ([logprob, token_id, text] per token) and
                             meta_info.finish_reason (null, or {"type": "stop" | "length" | "abort", ...})
    abort(ids | None)        POST /abort_request {rid}, then the stream is cut: the partial output
                             is what the stream had
    pause / resume           POST /pause_generation {mode: "abort"} (SGLang aborts every request in
                             flight) + POST /continue_generation {}; the streams are cut, park, and are
                             re-submitted on resume with their tokens as prompt and the rest of their
                             budget (the same stream to the caller), so their KV is recomputed on the
                             weights of then
    update_weights           a ``sync`` update (full or delta) or ``FullWeights``, applied with every
                             check to a host copy of the weights in Hugging Face names; that copy is
                             written as one safetensors file and loaded by POST /update_weights_from_disk
                             {model_path, weight_version}; then POST /flush_cache
    sleep / wake_up          POST /release_memory_occupation / /resume_memory_occupation {tags}
                             (memory is freed only by a server started with --enable-memory-saver);
                             waking the weights reloads the host copy: SGLang keeps their values only
                             with --enable-weights-cpu-backup
    reset_prefix_cache       POST /flush_cache (SGLang refuses it while requests run: HTTP 400)

Why from disk: /update_weights_from_tensor carries SGLang's own serialization of
torch tensors (pickled shared-memory or CUDA IPC handles), which needs the
sglang package in this process; a safetensors file needs only a path the
server can read (this host, or a shared directory), so the adapter stays plain
HTTP. A full update costs one write and one read of the model per sync.

Log-probs: for each sampled token SGLang reports log softmax(logits / T) (greedy:
of the raw logits), taken before top-k / top-p renormalisation (its sampler's
default; a server run with SGLANG_RETURN_ORIGINAL_LOGPROB=1 reports the raw
softmax instead and must not be used). Without top-k / top-p that is the
protocol's ``logprobs`` (the sampling distribution); ``raw_logprobs`` are filled
where they are the same (greedy, T=1) and left empty otherwise, as for vLLM.
Requests with top-k or top-p are refused: what SGLang reports for them is not
the distribution they sample from. The server must stream cumulative outputs
(its default: no --incremental-streaming-output).

Not verified against a real SGLang: only against ``tests/fake_sglang_server.py``,
a fake implementing these calls' documented schemas.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from actors.engines.adapted import copy_output, first_of
from actors.engines.base import EngineAsleepError, GenerateOutput, GenerateRequest, RolloutEngine

_LM_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"
_FINISH = {"stop": "stop", "length": "length"}
_TAGS = ("weights", "kv_cache")
_UPDATE_TIMEOUT_S = 600.0  # loading a large model from disk


class SglangServerError(RuntimeError):
    """The SGLang server could not be reached, did not answer in time, or answered
    with an error. The message names the server's URL and the call."""


# ---- HTTP/1.1: one connection per call, ``Connection: close`` -----------------------------------
class _Response:
    """A response's status and headers, its body read piece by piece (chunked,
    sized or to the end) and, for ``/generate``, as server-sent events."""

    def __init__(self, http: _Http, what: str, timeout_s: float, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.http, self.what, self.timeout_s = http, what, timeout_s
        self.reader, self.writer = reader, writer
        self.status, self.headers = 0, {}
        self._chunked = False
        self._left = -1  # the body's size when it is given; -1: chunked or up to the end
        self._ended = False
        self._buffer = b""

    async def _io(self, aw: Any) -> Any:
        return await self.http.io(aw, self.what, self.timeout_s)

    async def read_head(self) -> None:
        line = await self._io(self.reader.readline())
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise SglangServerError(f"the SGLang server at {self.http.url} answered {self.what} with no HTTP "
                                    f"status line: {line[:80]!r}")
        self.status = int(parts[1])
        while (line := await self._io(self.reader.readline())) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            self.headers[key.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in self.headers:
            self._left = int(self.headers["content-length"])

    async def piece(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        if self._ended:
            return b""
        if self._chunked:
            line = await self._io(self.reader.readline())
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise SglangServerError(f"the SGLang server at {self.http.url} broke off its answer to "
                                        f"{self.what} (chunk header {line[:40]!r})") from None
            data = await self._io(self.reader.readexactly(size + 2)) if size else b""
            self._ended = size == 0
            return data[:size]
        if self._left >= 0:
            data = await self._io(self.reader.readexactly(self._left)) if self._left else b""
            self._ended = True
            return data
        data = await self._io(self.reader.read(65536))
        self._ended = not data
        return data

    async def body(self) -> bytes:
        pieces = []
        while piece := await self.piece():
            pieces.append(piece)
        return b"".join(pieces)

    async def event(self) -> Any:
        """The next server-sent event's JSON; ``None`` after ``data: [DONE]``."""
        while True:
            event, sep, rest = self._buffer.partition(b"\n\n")
            if sep:
                self._buffer = rest
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        return None if payload == b"[DONE]" else msgspec.json.decode(payload)
                continue
            piece = await self.piece()
            if not piece:
                raise SglangServerError(f"the SGLang server at {self.http.url} ended its answer to {self.what} "
                                        f"before 'data: [DONE]'")
            self._buffer += piece

    def close(self) -> None:
        self.writer.close()

    def cut(self) -> None:
        """Drop the connection now: a read waiting on it sees its end."""
        self.writer.transport.abort()


class _Http:
    def __init__(self, url: str, timeout_s: float) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout_s = u.hostname, u.port, timeout_s
        self.url = f"http://{self.host}:{self.port}"

    async def io(self, aw: Any, what: str, timeout_s: float) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await aw
        except TimeoutError:  # before OSError: TimeoutError is one
            raise SglangServerError(f"the SGLang server at {self.url} did not answer {what} "
                                    f"within {timeout_s:g} s") from None
        except (OSError, asyncio.IncompleteReadError) as err:
            raise SglangServerError(f"the connection to the SGLang server at {self.url} broke during "
                                    f"{what}: {err!r}") from None

    async def send(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> _Response:
        """Connect and send a request; the response's head is not read yet."""
        what, timeout_s = f"{method} {path}", timeout_s or self.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port)
        except (TimeoutError, OSError) as err:
            why = f"no connection within {timeout_s:g} s" if isinstance(err, TimeoutError) else str(err)
            raise SglangServerError(f"cannot connect to the SGLang server at {self.url} ({what}): {why}; "
                                    f"is it running? (rollout.engine.url)") from None
        data = b"" if body is None else msgspec.json.encode(body)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return _Response(self, what, timeout_s, reader, writer)

    async def open(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> _Response:
        """Send a request; return the response with its head read."""
        resp = await self.send(method, path, body, timeout_s)
        try:
            await resp.read_head()
        except BaseException:
            resp.cut()
            raise
        return resp

    async def call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> bytes:
        """One request; its body. Raises :class:`SglangServerError` unless HTTP 200."""
        resp = await self.open(method, path, body, timeout_s)
        try:
            data = await resp.body()
        finally:
            resp.close()
        if resp.status != 200:
            raise SglangServerError(f"the SGLang server at {self.url} answered {resp.what} with HTTP "
                                    f"{resp.status}: {data[:500].decode('utf-8', 'replace')}")
        return data


# ---- the engine -------------------------------------------------------------------------------
class _Stream:
    """One request as the caller sees it, across its SGLang submissions."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.out = GenerateOutput(request_id=request.request_id)
        self.rid: str | None = None  # the SGLang request in flight
        self.resp: _Response | None = None  # and its connection
        self.cut = False  # that connection was cut by pause / abort
        self.aborted = False  # by the caller
        self.parked = asyncio.Event()  # cut by a pause, waiting for resume
        self.done = asyncio.Event()
        self.wake = asyncio.Event()  # resume or abort while parked

    def cut_connection(self) -> None:
        self.cut = True
        if self.resp is not None:
            self.resp.cut()


class SglangEngine(RolloutEngine):
    """``url``: a running SGLang server serving ``model_path``'s model (None: launch one
    on a free loopback port, with ``device`` (``cuda:i``: GPU ``i``; on CUDA with
    --enable-memory-saver, so that sleep frees memory), ``dtype``, ``max_num_seqs``
    (--max-running-requests), ``max_model_len`` (--context-length) and ``seed``).
    ``dtype`` is also that of the host copy of the weights (one model's size of host
    memory) and of the files updates are loaded from, written under ``weights_dir``
    (None: the system's temporary directory; the server must read it at the same path).
    ``timeout_s``: the longest wait for the server, to connect, for an answer, and
    between two events of a stream."""

    def __init__(self, model_path: str, *, url: str | None = None, device: str = "cpu", dtype: str = "float32",
                 max_num_seqs: int = 128, max_model_len: int = 128, seed: int = 0, timeout_s: float = 300.0,
                 launch_timeout_s: float = 900.0, weights_dir: str | None = None) -> None:
        self.model_path, self.url, self.device, self.dtype = model_path, url, device, dtype
        self.max_num_seqs, self.max_model_len, self.seed = max_num_seqs, max_model_len, seed
        self.timeout_s, self.launch_timeout_s, self.weights_dir = timeout_s, launch_timeout_s, weights_dir
        self._http: _Http | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None  # holds the file updates are loaded from
        self._weights: dict[str, Any] = {}  # host copy, Hugging Face names, engine dtype
        self._tied = False  # lm_head is the embedding (not held apart)
        self._version = 0
        self._streams: dict[str, _Stream] = {}
        self._paused = False
        self._freed: set[str] = set()  # what sleep freed: "weights", "kv_cache"
        self._tag, self._rids = secrets.token_hex(4), itertools.count()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        import torch
        from safetensors.torch import load_file

        from actors.models import resolve_model_path

        path = resolve_model_path(self.model_path)
        dtype = getattr(torch, self.dtype)
        for f in sorted(path.glob("*.safetensors")):
            self._weights.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
        config = json.loads((path / "config.json").read_text())
        self._tied = bool(config.get("tie_word_embeddings", False))
        if self._tied:  # SGLang, like Hugging Face, takes the head from the embedding
            self._weights.pop(_LM_HEAD, None)
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-sglang-", dir=self.weights_dir))
        shutil.copy(path / "config.json", self._dir / "config.json")
        try:
            if self.url is None:
                self.url = await self._launch(path)
            self._http = _Http(self.url, self.timeout_s)
            info = msgspec.json.decode(await self._http.call("GET", "/get_model_info"))
            if not info.get("is_generation", True):
                raise SglangServerError(f"the SGLang server at {self.url} serves a model that does not "
                                        f"generate ({info.get('model_path')!r})")
        except BaseException:
            await self.close()  # a launched server, the weights directory
            raise

    async def _launch(self, path: Path) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kind, _, index = self.device.partition(":")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(path), "--host", "127.0.0.1",
               "--port", str(port), "--skip-tokenizer-init", "--dtype", self.dtype, "--device", kind,
               "--context-length", str(self.max_model_len), "--max-running-requests", str(self.max_num_seqs),
               "--random-seed", str(self.seed)]
        if kind == "cuda":
            cmd += ["--enable-memory-saver"] + (["--base-gpu-id", index] if index else [])
        env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}  # see the docstring
        self._proc = subprocess.Popen(cmd, env=env)
        url, loop = f"http://127.0.0.1:{port}", asyncio.get_running_loop()
        probe, deadline = _Http(url, 5.0), loop.time() + self.launch_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise SglangServerError(f"the SGLang server launched at {url} exited with code "
                                        f"{self._proc.returncode} before it was ready: {' '.join(cmd)}")
            try:
                await probe.call("GET", "/health")
                return url
            except SglangServerError:
                if loop.time() > deadline:
                    raise SglangServerError(f"the SGLang server launched at {url} was not ready within "
                                            f"{self.launch_timeout_s:g} s: {' '.join(cmd)}") from None
            await asyncio.sleep(0.25)

    async def close(self) -> None:
        try:
            if self._http is not None and self._streams:
                await self.abort(None)
        finally:
            self._http = None
            if self._proc is not None:
                self._proc.terminate()
                for _ in range(300):  # 30 s
                    if self._proc.poll() is not None:
                        break
                    await asyncio.sleep(0.1)
                else:
                    self._proc.kill()
                self._proc = None
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    @property
    def version(self) -> int:
        return self._version

    def named_weights(self) -> dict[str, Any]:
        """The weights last loaded into SGLang, by Hugging Face name (the host copy
        updates are applied to, with checks). A tied ``lm_head.weight`` is listed
        too, as the embedding, like ``state_dict()``."""
        out = dict(self._weights)
        if self._tied:
            out[_LM_HEAD] = out[_EMBED]
        return out

    # ---- generation ----------------------------------------------------------------------------
    def _body(self, st: _Stream) -> dict[str, Any]:
        req, done = st.request, st.out.token_ids
        s = req.sampling
        sampling: dict[str, Any] = {"max_new_tokens": req.max_tokens - len(done), "temperature": s.temperature,
                                    "ignore_eos": True}
        if s.stop_token_ids:
            sampling["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed is not None:
            sampling["sampling_seed"] = s.seed
        return {"rid": st.rid, "input_ids": list(req.prompt_ids) + done, "sampling_params": sampling,
                "return_logprob": True, "logprob_start_len": -1, "stream": True}

    def _take(self, st: _Stream, event: Any, base: int, raw_ok: bool) -> tuple[str | None, int]:
        """Add an event's new tokens to ``st.out``: (its finish type or None, how many came)."""
        if "error" in event:
            raise SglangServerError(f"the SGLang server at {self.url} failed request "
                                    f"{st.request.request_id!r}: {event['error']}")
        meta, out = event["meta_info"], st.out
        ids, lps = event["output_ids"], meta.get("output_token_logprobs") or []
        start, end = len(out.token_ids) - base, min(len(ids), len(lps))
        for k in range(start, end):
            if lps[k][1] != ids[k]:
                raise SglangServerError(f"the SGLang server at {self.url}: request {st.request.request_id!r}: "
                                        f"log-prob {k} is of token {lps[k][1]}, output token {k} is {ids[k]}")
            out.token_ids.append(ids[k])
            out.logprobs.append(float(lps[k][0]))
            if raw_ok:
                out.raw_logprobs.append(float(lps[k][0]))
            out.token_versions.append(self._version)
        finish = meta.get("finish_reason")
        kind = None if finish is None else finish.get("type")
        if kind in _FINISH and len(ids) != len(lps):
            raise SglangServerError(f"the SGLang server at {self.url} finished request "
                                    f"{st.request.request_id!r} with {len(ids)} tokens and {len(lps)} log-probs")
        if kind is not None and kind not in _FINISH and kind != "abort":
            raise SglangServerError(f"the SGLang server at {self.url}: unknown finish_reason {finish!r}")
        return kind, max(0, end - start)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if self._freed:
            raise EngineAsleepError("the engine is asleep: wake_up() first")
        if request.request_id in self._streams:
            raise ValueError(f"request {request.request_id!r} is already running")
        s = request.sampling
        if s.top_k > 0 or s.top_p < 1.0:
            raise ValueError(f"request {request.request_id!r}: top_k={s.top_k}, top_p={s.top_p}: the sglang engine "
                             "samples with a temperature only (SGLang reports log-probs before top-k / top-p "
                             "renormalisation, not those of the distribution sampled from); set rollout.top_k=0 "
                             "and rollout.top_p=1.0")
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has empty prompt_ids")
        st = _Stream(request)
        self._streams[request.request_id] = st
        raw_ok, out, finish = s.temperature in (0.0, 1.0), st.out, None
        try:
            while not st.aborted and len(out.token_ids) < request.max_tokens:
                if self._paused:
                    st.parked.set()
                    st.wake.clear()
                    await st.wake.wait()
                    continue
                st.parked.clear()
                st.cut, st.rid, base = False, f"asyncrl-{self._tag}-{next(self._rids):012d}", len(out.token_ids)
                # fixed-width ids: SGLang aborts every rid that *starts with* the one named
                try:
                    st.resp = await self._http.send("POST", "/generate", self._body(st))
                    if st.cut:  # while connecting
                        continue
                    await st.resp.read_head()  # a cut from here on ends the read at once
                    if st.resp.status != 200:
                        raise SglangServerError(f"the SGLang server at {self.url} refused request "
                                                f"{request.request_id!r}: HTTP {st.resp.status}: "
                                                f"{(await st.resp.body())[:500].decode('utf-8', 'replace')}")
                    while (event := await st.resp.event()) is not None:
                        kind, num_new = self._take(st, event, base, raw_ok)
                        if kind is None:
                            if num_new:
                                yield copy_output(out)
                            continue
                        if kind == "abort" and not (st.aborted or st.cut or self._paused):
                            raise SglangServerError(f"the SGLang server at {self.url} aborted request "
                                                    f"{request.request_id!r}: {event['meta_info']['finish_reason']}")
                        finish = _FINISH.get(kind)
                        break
                except SglangServerError:
                    if not st.cut:
                        raise
                finally:
                    if st.resp is not None:
                        st.resp.close()
                    st.resp, st.rid = None, None
                if finish is not None:
                    break
                # cut, or aborted by our pause: a pause parks the stream, an abort ends it
            out.finish_reason = "abort" if st.aborted else finish or "length"
            yield copy_output(out)
        finally:
            st.parked.set()
            st.done.set()
            self._streams.pop(request.request_id, None)

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        targets = list(self._streams.values()) if request_ids is None else \
            [self._streams[i] for i in request_ids if i in self._streams]
        for st in targets:
            st.aborted = True
            st.wake.set()
        in_flight = [st.rid for st in targets if st.rid is not None]
        try:  # stop the server's work first; the streams end whatever it answers
            await asyncio.gather(*(self._http.call("POST", "/abort_request", {"rid": rid}) for rid in in_flight))
        finally:
            for st in targets:
                st.cut_connection()
            await asyncio.gather(*(st.done.wait() for st in targets))
        return [copy_output(st.out) for st in targets]

    async def pause(self) -> None:
        """SGLang aborts every request in flight and holds new ones; each stream
        parks with its tokens and goes on after :meth:`resume`."""
        if self._paused:
            return
        self._paused = True
        await self._http.call("POST", "/pause_generation", {"mode": "abort"})
        streams = list(self._streams.values())
        for st in streams:  # what they read from now on is dropped: no token comes after pause()
            st.cut_connection()
        await asyncio.gather(*(first_of(st.parked, st.done) for st in streams))

    async def resume(self) -> None:
        if not self._paused:
            return
        await self._http.call("POST", "/continue_generation", {})
        self._paused = False
        for st in list(self._streams.values()):
            st.wake.set()

    async def reset_prefix_cache(self) -> None:
        await self._http.call("POST", "/flush_cache")

    # ---- weights and memory --------------------------------------------------------------------
    async def update_weights(self, update: object) -> int:
        from actors.engines.weights import FullWeights

        if isinstance(update, FullWeights):
            import torch

            dtype = getattr(torch, self.dtype)
            tensors = {n: t for n, t in update.tensors.items() if not (self._tied and n == _LM_HEAD)}
            missing = sorted(set(self._weights) - set(tensors))
            unknown = sorted(set(tensors) - set(self._weights))
            if missing or unknown:
                raise ValueError(f"full weight update: missing {missing[:5]}, unknown {unknown[:5]}")
            self._weights.update({n: t.detach().to("cpu", dtype) for n, t in tensors.items()})
            version = int(update.version)
        else:
            from sync.apply import apply_update

            names = {e.name for e in update.manifest.entries}
            targets = dict(self._weights)
            if self._tied and _LM_HEAD in names:  # a sender that did not tie them: the head is the embedding
                embed = self._weights[_EMBED]
                targets[_LM_HEAD] = embed.clone() if _EMBED in names else embed
            version = await asyncio.to_thread(apply_update, targets, update, self._version)  # checks first
        if "weights" in self._freed:  # SGLang's weight memory is released: wake_up() loads them
            self._version = version
            return version
        was_paused = self._paused
        if not was_paused:  # requests in flight must not keep KV of the old weights
            await self.pause()
        try:
            await self._load_into_server(version)
            self._version = version
        finally:
            if not was_paused:
                await self.resume()
        return self._version

    async def _load_into_server(self, version: int) -> None:
        await asyncio.to_thread(self._write_weights)
        res = msgspec.json.decode(await self._http.call(
            "POST", "/update_weights_from_disk", {"model_path": str(self._dir), "weight_version": str(version)},
            timeout_s=max(self.timeout_s, _UPDATE_TIMEOUT_S)))
        if not res.get("success"):
            raise SglangServerError(f"the SGLang server at {self.url} did not load the weights: {res.get('message')}")
        await self._http.call("POST", "/flush_cache")  # no prefix computed on the old weights is reused

    def _write_weights(self) -> None:
        from safetensors.torch import save_file

        partial = self._dir / "model.safetensors.partial"  # not *.safetensors: SGLang loads every one
        save_file({n: t.contiguous() for n, t in self._weights.items()}, str(partial), metadata={"format": "pt"})
        os.replace(partial, self._dir / "model.safetensors")

    async def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 (KV cache) or 2 (KV cache and weights)")
        tags = ["kv_cache"] + (["weights"] if level == 2 else [])
        await self._http.call("POST", "/release_memory_occupation", {"tags": tags})
        self._freed |= set(tags)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(_TAGS) if tags is None else list(tags)
        unknown = set(tags) - set(_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} unknown (use 'weights', 'kv_cache')")
        freed = [t for t in _TAGS if t in tags and t in self._freed]
        if freed:
            await self._http.call("POST", "/resume_memory_occupation", {"tags": freed})
        if "weights" in freed:
            await self._load_into_server(self._version)
        self._freed -= set(tags)

    def statistics(self) -> dict[str, Any]:
        return {"num_running": len(self._streams), "version": self._version}
