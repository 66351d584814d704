"""A FAKE SGLang server, for tests only. It is not SGLang and runs no SGLang code.

It answers, on 127.0.0.1 only, exactly the HTTP calls the SGLang adapter
(``actors/engines/sglang_engine.py``) makes, with the request and response JSON
of SGLang's documented schemas, as read in the sglang repository
(github.com/sgl-project/sglang; http_server.py at 0025436e, io_struct.py and
tokenizer_manager.py at 001067ff, sampling_params.py at 00c17caf):

    python/sglang/srt/entrypoints/http_server.py   routes, status codes, response bodies
    python/sglang/srt/managers/io_struct.py        GenerateReqInput, AbortReq, PauseGenerationReqInput,
                                                   ContinueGenerationReqInput, UpdateWeightFromDiskReqInput,
                                                   Release/ResumeMemoryOccupationReqInput
    python/sglang/srt/managers/tokenizer_manager.py   meta_info of /generate, pause in "abort" mode
    python/sglang/srt/sampling/sampling_params.py  sampling_params fields (greedy below T=1e-6)
    python/sglang/srt/managers/schedule_batch.py   finish_reason JSON ({"type": "stop", "matched": id}, ...)
    python/sglang/srt/layers/sampler.py            reported log-prob: log softmax(logits / T), greedy: raw

Generation is the project's built-in torch engine on the checkpoint served, so
log-probs are real and a weight update changes what comes out.

What it emulates: ``/generate`` streamed as server-sent events (cumulative
``output_ids``; ``meta_info.output_token_logprobs`` as ``[logprob, token_id,
null]``; ``meta_info.finish_reason``; chunked transfer encoding, as uvicorn
sends a streaming response; a sampling error as a ``data: {"error": ...}``
event); ``/abort_request`` (every rid that starts with the one named, as
SGLang's scheduler does); ``/pause_generation`` in ``abort`` mode (aborts every
request, answers once they have ended, holds new ones until
``/continue_generation``); ``/update_weights_from_disk`` (every ``*.safetensors``
of ``model_path``); ``/release_memory_occupation`` (refused while requests run;
released weights lose their values, as on a server with --enable-memory-saver
and no --enable-weights-cpu-backup: they read zeros until weights are loaded
again); ``/resume_memory_occupation``; ``/flush_cache`` (HTTP 400 while
requests run); ``/get_model_info``; ``/health``.

Stricter than SGLang, to catch schema drift: any field SGLang does not have is
HTTP 400, and so is a field SGLang has that this fake does not implement:
top-k / top-p, text prompts, ``stream: false``, pause modes other than
``abort``, other load formats. Requests are validated by msgspec Structs whose
field names, types and defaults follow SGLang's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import uuid
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from actors.engines.base import GenerateRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine
from actors.engines.weights import FullWeights

_TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
_Strict = dict(forbid_unknown_fields=True, kw_only=True)


# ---- request schemas (SGLang's names, types and defaults; the subset this fake implements) ------
class Sampling(msgspec.Struct, **_Strict):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _TOP_K_ALL
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None


class Generate(msgspec.Struct, **_Strict):
    input_ids: list[int]
    rid: str | None = None
    sampling_params: Sampling = msgspec.field(default_factory=Sampling)
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    stream: bool = False


class Abort(msgspec.Struct, **_Strict):
    rid: str = ""
    abort_all: bool = False


class Pause(msgspec.Struct, **_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class Continue(msgspec.Struct, **_Strict):
    torch_empty_cache: bool = True


class UpdateFromDisk(msgspec.Struct, **_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class Memory(msgspec.Struct, **_Strict):
    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class _BadRequest(Exception):
    pass


def _decode(body: bytes, schema: type) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=schema)
    except msgspec.DecodeError as err:  # FastAPI's validation error, turned into 400 by SGLang
        raise _BadRequest(str(err)) from None


def _not_implemented(what: str) -> _BadRequest:
    return _BadRequest(f"FAKE SGLang server (tests/fake_sglang_server.py) does not implement {what}")


class FakeSglangServer:
    """Serve ``model_path`` on 127.0.0.1 (``port`` 0: a free one; :attr:`url` after :meth:`start`).
    ``calls`` lists every request as "METHOD /path", in order."""

    def __init__(self, model_path: str, *, max_num_seqs: int = 4, max_model_len: int = 128, seed: int = 0,
                 device: str = "cpu", dtype: str = "float32", port: int = 0) -> None:
        self.model_path, self.port = str(model_path), port
        self.engine = TorchEngine(self.model_path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, seed=seed, cuda_graphs=False)
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self.eos_token_id = config.get("eos_token_id")
        self.calls: list[str] = []
        self.weight_version = "default"
        self.num_weight_loads = 0
        self.num_held = 0  # /generate requests that came while paused
        self.released: set[str] = set()
        self._server: asyncio.Server | None = None
        self._running: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._routes = {
            "/health": ("GET", self._health), "/get_model_info": ("GET", self._model_info),
            "/generate": ("POST", self._generate), "/abort_request": ("POST", self._abort),
            "/pause_generation": ("POST", self._pause), "/continue_generation": ("POST", self._continue),
            "/update_weights_from_disk": ("POST", self._update), "/flush_cache": ("GET POST", self._flush),
            "/release_memory_occupation": ("GET POST", self._release),
            "/resume_memory_occupation": ("GET POST", self._resume),
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.engine.setup()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        await self.engine.close()

    # ---- HTTP ----------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path, body = await _read_request(reader)
            self.calls.append(f"{method} {path}")
            route = self._routes.get(path)
            if route is None:
                return _send(writer, 404, {"detail": "Not Found"})
            if method not in route[0].split():
                return _send(writer, 405, {"detail": "Method Not Allowed"})
            await route[1](body, reader, writer)
        except _BadRequest as err:  # SGLang's ErrorResponse for a request that fails validation
            _send(writer, 400, {"object": "error", "message": str(err), "type": "Bad Request", "param": None,
                                "code": 400})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    # ---- routes --------------------------------------------------------------------------------
    async def _health(self, body, reader, writer) -> None:
        _send(writer, 200, b"")

    async def _model_info(self, body, reader, writer) -> None:
        _send(writer, 200, {"model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
                            "preferred_sampling_params": None, "weight_version": self.weight_version})

    async def _generate(self, body, reader, writer) -> None:
        req = _decode(body, Generate)
        sp = req.sampling_params
        if not req.stream:
            raise _not_implemented("stream: false")
        if req.return_logprob is not True or req.logprob_start_len not in (None, -1):
            raise _not_implemented("/generate without return_logprob: true, logprob_start_len: -1")
        if sp.top_k not in (-1, _TOP_K_ALL) or sp.top_p != 1.0:
            raise _not_implemented("top_k / top_p")
        if not req.input_ids:
            raise _BadRequest("input_ids cannot be empty.")
        rid = req.rid or uuid.uuid4().hex
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                     b"connection: close\r\n\r\n")
        self.num_held += not self._unpaused.is_set()
        await self._unpaused.wait()  # a paused SGLang holds new requests (after the head: a streaming response)
        error = _sampling_error(sp)
        if error is not None:  # SGLang streams a ValueError as an event
            _chunk(writer, b"data: " + msgspec.json.encode({"error": {"message": error}}) + b"\n\n")
        else:
            await self._stream(req, rid, reader, writer)
        _chunk(writer, b"data: [DONE]\n\n")
        _chunk(writer, b"")

    async def _stream(self, req: Generate, rid: str, reader, writer) -> None:
        sp = req.sampling_params
        stops = set(sp.stop_token_ids or ())
        if not sp.ignore_eos and isinstance(self.eos_token_id, int):
            stops.add(self.eos_token_id)
        greedy = sp.temperature < 1e-6  # SGLang: top_k=1, T=1; its log-probs are then the raw ones
        sampling = SamplingParams(temperature=0.0 if greedy else sp.temperature, seed=sp.sampling_seed,
                                  stop_token_ids=tuple(sorted(stops)))
        max_new = 128 if sp.max_new_tokens is None else sp.max_new_tokens
        self._running.add(rid)
        self._idle.clear()
        outputs = self.engine.stream(GenerateRequest(request_id=rid, prompt_ids=list(req.input_ids),
                                                     max_tokens=max_new, sampling=sampling))
        try:
            if max_new == 0:
                _chunk(writer, self._event(rid, req, [], [], {"type": "length", "length": 0}))
                return
            async for out in outputs:
                if writer.is_closing() or reader.at_eof():  # the client left: SGLang aborts the request
                    return
                finish = None
                if out.finish_reason == "length":
                    finish = {"type": "length", "length": len(out.token_ids)}
                elif out.finish_reason == "stop":
                    finish = {"type": "stop", "matched": out.token_ids[-1]}
                elif out.finish_reason == "abort":
                    finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                              "err_type": None}
                _chunk(writer, self._event(rid, req, out.token_ids, out.logprobs, finish))
                await writer.drain()
        finally:
            await outputs.aclose()  # the torch engine aborts a request its consumer left
            self._running.discard(rid)
            if not self._running:
                self._idle.set()

    def _event(self, rid: str, req: Generate, ids: list[int], lps: list[float], finish: Any) -> bytes:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(req.input_ids),
                "weight_version": self.weight_version, "completion_tokens": len(ids), "cached_tokens": 0,
                "input_token_logprobs": [], "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}
        return b"data: " + msgspec.json.encode({"output_ids": ids, "meta_info": meta}) + b"\n\n"

    async def _abort(self, body, reader, writer) -> None:
        req = _decode(body, Abort)
        hit = list(self._running) if req.abort_all else [r for r in self._running if req.rid and r.startswith(req.rid)]
        if hit:
            await self.engine.abort(hit)
        _send(writer, 200, b"")

    async def _pause(self, body, reader, writer) -> None:
        if _decode(body, Pause).mode != "abort":
            raise _not_implemented("pause modes other than 'abort'")
        self._unpaused.clear()
        if self._running:
            await self.engine.abort(list(self._running))
        await self._idle.wait()
        _send(writer, 200, {"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, body, reader, writer) -> None:
        _decode(body, Continue)
        self._unpaused.set()
        _send(writer, 200, {"message": "Generation continued successfully.", "status": "ok"})

    async def _update(self, body, reader, writer) -> None:
        from safetensors.torch import load_file

        req = _decode(body, UpdateFromDisk)
        if req.load_format not in (None, "auto", "safetensors"):
            raise _not_implemented(f"load_format={req.load_format!r}")
        if self._unpaused.is_set():  # not paused: SGLang waits for requests in flight
            await self._idle.wait()
        files = sorted(Path(req.model_path).glob("*.safetensors"))
        try:
            if not files:
                raise ValueError(f"no *.safetensors in {req.model_path!r}")
            tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
            await self.engine.update_weights(FullWeights(self.num_weight_loads + 1, tensors))
        except (ValueError, OSError, RuntimeError) as err:
            return _send(writer, 400, {"success": False, "message": f"Failed to update weights: {err}",
                                       "num_paused_requests": 0})
        self.num_weight_loads += 1
        if req.flush_cache:
            await self.engine.reset_prefix_cache()
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            self.weight_version = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        _send(writer, 200, {"success": True, "message": message, "num_paused_requests": 0})

    async def _flush(self, body, reader, writer) -> None:
        text = (b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                b"waiting requests, the operation will not be performed.)\n")
        if self._running:
            return _send(writer, 400, text)
        await self.engine.reset_prefix_cache()
        _send(writer, 200, text)

    async def _release(self, body, reader, writer) -> None:
        tags = set(_decode(body, Memory).tags or ("weights", "kv_cache", "cuda_graph"))
        if self._running:  # SGLang asserts an idle scheduler
            return _send(writer, 400, {"error": {"message": "release_memory_occupation needs an idle server"}})
        if "weights" in tags and "weights" not in self.released:
            zeros = {n: torch.zeros_like(t) for n, t in self.engine.named_weights().items()}
            await self.engine.update_weights(FullWeights(self.engine.version + 1, zeros))
        self.released |= tags
        _send(writer, 200, b"null")

    async def _resume(self, body, reader, writer) -> None:
        self.released -= set(_decode(body, Memory).tags or ("weights", "kv_cache", "cuda_graph"))
        _send(writer, 200, b"null")


def _sampling_error(sp: Sampling) -> str | None:
    """SGLang's ``SamplingParams.verify`` for the fields this fake takes."""
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        return f"temperature must be a non-negative finite number, got {sp.temperature}."
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        return f"max_new_tokens must be at least 0, got {sp.max_new_tokens}."
    return None


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    method, path, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _not_implemented("chunked request bodies")
    size = int(headers.get("content-length", 0))
    return method, path.split("?", 1)[0], await reader.readexactly(size) if size else b""


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _send(writer: asyncio.StreamWriter, status: int, body: Any) -> None:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    kind = b"application/json" if not isinstance(body, bytes) or data == b"null" else b"text/plain; charset=utf-8"
    writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                 % (status, _REASONS[status].encode(), kind, len(data)) + data)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def main(argv: list[str] | None = None) -> None:
    """``python -m sglang.launch_server`` as the adapter calls it (a test puts a
    shim ``sglang`` package on the path): exactly the flags it passes, under
    SGLang's names; any other flag is an error."""
    p = argparse.ArgumentParser(prog="fake sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", choices=["127.0.0.1"], required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=4)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--base-gpu-id", type=int, default=0)
    a = p.parse_args(argv)
    device = a.device if a.device == "cpu" else f"cuda:{a.base_gpu_id}"

    async def serve() -> None:
        server = FakeSglangServer(a.model_path, max_num_seqs=a.max_running_requests, max_model_len=a.context_length,
                                  seed=a.random_seed, device=device, dtype=a.dtype, port=a.port)
        await server.start()
        await asyncio.Event().wait()  # until the process is terminated

    asyncio.run(serve())
