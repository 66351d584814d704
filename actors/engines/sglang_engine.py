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
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from safetensors.torch import save_file

from actors.engines.adapted import AdaptedEngine, AdaptedStream
from actors.engines.base import MEMORY_TAGS, EngineUpdate, GenerateOutput, GenerateRequest, copy_output
from actors.engines.config import EngineConfig
from actors.engines.sglang_http import SglangHttp, SglangResponse, SglangServerError
from actors.engines.weights import LM_HEAD

__all__ = ["SglangEngine", "SglangServerError"]

_FINISH = {"stop": "stop", "length": "length"}
_UPDATE_TIMEOUT_S = 600.0  # loading a large model from disk


class _Stream(AdaptedStream):
    """One request as the caller sees it, across its SGLang submissions."""

    def __init__(self, request: GenerateRequest) -> None:
        super().__init__(request)
        self.rid: str | None = None  # the SGLang request in flight
        self.resp: SglangResponse | None = None  # and its connection
        self.cut = False  # that connection was cut by pause / abort

    def cut_connection(self) -> None:
        self.cut = True
        if self.resp is not None:
            self.resp.cut()


class SglangEngine(AdaptedEngine[_Stream]):
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
        super().__init__(model_path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, seed=seed)
        self.url, self.timeout_s, self.launch_timeout_s = url, timeout_s, launch_timeout_s
        self.weights_dir = weights_dir
        self._http: SglangHttp | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None  # holds the file updates are loaded from
        self._tag, self._rids = secrets.token_hex(4), itertools.count()

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, *, seed: int) -> SglangEngine:
        """The engine ``rollout.engine`` describes (``type: sglang``: :mod:`actors.engines.registry`)."""
        return cls(model_path, url=cfg.url, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                   max_model_len=cfg.max_model_len, seed=seed)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def setup(self) -> None:
        path, self._tied = self._read_checkpoint()
        if self._tied:  # SGLang, like Hugging Face, takes the head from the embedding
            self._weights.pop(LM_HEAD, None)
        self._dir = Path(tempfile.mkdtemp(prefix="asyncrl-sglang-", dir=self.weights_dir))
        shutil.copy(path / "config.json", self._dir / "config.json")
        try:
            if self.url is None:
                self.url = await self._launch(path)
            self._http = SglangHttp(self.url, self.timeout_s)
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
        probe, deadline = SglangHttp(url, 5.0), loop.time() + self.launch_timeout_s
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

    # ---- generation ----------------------------------------------------------------------------
    def _body(self, st: _Stream) -> dict[str, object]:
        req, done = st.request, st.out.token_ids
        s = req.sampling
        sampling: dict[str, object] = {"max_new_tokens": req.max_tokens - len(done), "temperature": s.temperature,
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
        self._check_new(request)
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
                if await self._park_if_paused(st):
                    continue
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
            self._end(st)

    async def abort(self, request_ids: list[str] | None = None) -> list[GenerateOutput]:
        targets = self._mark_aborted(request_ids)
        in_flight = [st.rid for st in targets if st.rid is not None]
        try:  # stop the server's work first; the streams end whatever it answers
            await asyncio.gather(*(self._http.call("POST", "/abort_request", {"rid": rid}) for rid in in_flight))
        finally:
            for st in targets:
                st.cut_connection()
            outputs = await self._outputs_when_done(targets)
        return outputs

    async def _set_paused(self, paused: bool) -> None:
        """Pausing, SGLang aborts every request in flight and holds new ones; each
        stream parks with its tokens and goes on after resuming."""
        if paused == self._paused:
            return
        if paused:
            self._paused = True
            await self._http.call("POST", "/pause_generation", {"mode": "abort"})
            streams = list(self._streams.values())
            for st in streams:  # what they read from now on is dropped: no token comes after pause()
                st.cut_connection()
            await self._until_parked(streams)
            return
        await self._http.call("POST", "/continue_generation", {})
        self._paused = False
        self._wake_all()

    async def reset_prefix_cache(self) -> None:
        await self._http.call("POST", "/flush_cache")

    # ---- weights and memory --------------------------------------------------------------------
    async def update_weights(self, update: EngineUpdate) -> int:
        version = await self._apply_to_host(update, require_all=True)
        if "weights" in self._freed:  # SGLang's weight memory is released: wake_up() loads them
            self._version = version
            return version
        return await self._load_paused(lambda: self._load_into_server(version), version)

    async def _load_into_server(self, version: int) -> None:
        await asyncio.to_thread(self._write_weights)
        res = msgspec.json.decode(await self._http.call(
            "POST", "/update_weights_from_disk", {"model_path": str(self._dir), "weight_version": str(version)},
            timeout_s=max(self.timeout_s, _UPDATE_TIMEOUT_S)))
        if not res.get("success"):
            raise SglangServerError(f"the SGLang server at {self.url} did not load the weights: {res.get('message')}")
        await self._http.call("POST", "/flush_cache")  # no prefix computed on the old weights is reused

    def _write_weights(self) -> None:
        partial = self._dir / "model.safetensors.partial"  # not *.safetensors: SGLang loads every one
        save_file({n: t.contiguous() for n, t in self._weights.items()}, str(partial), metadata={"format": "pt"})
        os.replace(partial, self._dir / "model.safetensors")

    async def _set_memory(self, tags: list[str], *, resident: bool) -> None:
        if not resident:
            await self._http.call("POST", "/release_memory_occupation", {"tags": tags})
            self._freed |= set(tags)
            return
        freed = [t for t in MEMORY_TAGS if t in tags and t in self._freed]
        if freed:
            await self._http.call("POST", "/resume_memory_occupation", {"tags": freed})
        if "weights" in freed:
            await self._load_into_server(self._version)
        self._freed -= set(tags)
