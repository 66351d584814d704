"""Weight-sync benchmark: full vs delta pushes after a real optimizer step.

    python -m bench.weight_sync [--small] [--device cpu|cuda] [--transports inproc,ray,gloo]

``pickle`` (another process, sent the update itself: device buckets as host
arrays) is what CUDA IPC saves on one GPU when actors run in their own processes.

A Qwen2.5-0.5B-shaped model (random init) takes one AdamW step per learning
rate. By default it trains the way the torch backend does with a bf16 model
(Megatron-style mixed precision, ``actors/backends/mixed_precision.py``): fp32
main params in the optimizer, bf16 model params written by the step, and the
sync reads the bf16 model params, so neither full nor delta pays a cast.
``--model-params fp32`` keeps an fp32 model instead, and then both kinds cast
to the engine's bf16 inside the sync. For each step
the same version is pushed as a delta and as a full update through every
transport, and we print one JSON object: changed fraction, bytes sent, bytes
per changed element, and per transport and kind the whole push (encode, stage,
transfer and apply in one timed span) as the median over repeats with its min
and max, each component's minimum beside it, which kind was faster, and
``default``: the kind the default ``sync.mode`` (``auto``) pushes over that
transport (``sync.auto.mode_for``), with its median push and engine pause.

    Each repeat, on each transport in turn, times the delta and then the full
    push of the same version from the same base (then takes the delta back,
    untimed), so noise on this shared host falls on both kinds; every push
    encodes its own update, as a real sync does. Every timed push starts after
    a short pause (``--settle-s``, full and delta alike), so background work
    left by the previous push (Ray freeing objects) is not billed to the next.

    push_ms_median:   encode + stage + transfer + apply, measured as one span per
                      repeat; the median (``median_low``: one measured push), with
                      push_ms_min / push_ms_max and every repeat (push_ms_repeats)
    component_min_ms: each component's fastest repeat, from different repeats;
                      sum_of_component_minima_ms adds them: a composite lower
                      bound under the whole push, not a push anyone measured
      encode:   the sender's encode of the update
      stage:    inproc and cuda_ipc, as ``sync.sequence`` does before the pause:
                publish + the receiver's check of a planned full payload
                (``stage_update``), wall time until it answers (over CUDA IPC the
                apply is sent right behind it, as ``sync.sequence`` sends the
                swap); 0 elsewhere
      transfer: publish + deliver (ray.put + ray.get, gloo broadcast, IPC open),
                measured as receiver-acknowledged wall time minus its apply time
                (and minus the stage before it)
      apply:    receive + apply_update on the receiver (payload checks, decode,
                write, verify; a staged payload: the copy alone)
    paused_ms_*:      the apply of the same repeat (with the receive of the payload,
                      gloo's broadcast aside): what an engine's swap holds it for,
                      one step between two decode steps; the encode, the stage and
                      the control messages run while it still generates
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from actors.backends.mixed_precision import MainParamsOptimizer
from sync import WeightSender, apply_update, codec, pool
from sync.apply import stage_update, stageable
from sync.auto import mode_for
from contracts.weights import WeightUpdate
from sync.transport import make_transport

LRS = (1e-6, 1e-5)
# the run's transport each bench transport stands for (sync.auto.mode_for): gloo is the
# broadcast over gloo; pickle, another process sent a serialized copy, is Ray's object store
CONFIG_TRANSPORT = {"inproc": "inproc", "cuda_ipc": "cuda_ipc", "ray": "ray", "gloo": "broadcast", "pickle": "ray"}


def model_config(small: bool) -> Any:
    import transformers

    if small:
        dims = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=512, vocab_size=8192)
    else:  # Qwen2.5-0.5B
        dims = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936)
    return transformers.Qwen2Config(tie_word_embeddings=True, max_position_embeddings=4096, **dims)


def engine_shapes(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """HF names the engine holds: tied aliases (lm_head -> embedding) once."""
    seen, out = set(), {}
    for name, t in weights.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = tuple(t.shape)
    return out


def optimizer_step(model: torch.nn.Module, opt: Any, lr: float, seed: int, device: str) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=g).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if isinstance(opt, MainParamsOptimizer):
        opt.clip_and_step(float("inf"))  # fp32 main params step, bf16 model params follow
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)  # the grads' memory is not needed during the sync


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- receivers


class InProcessReceiver:
    name = "inproc"

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: str) -> None:
        self.weights = {k: torch.zeros(s, dtype=torch.bfloat16, device=device) for k, s in shapes.items()}
        self.version, self.device = 0, device
        self.transport = make_transport("inproc")

    def push(self, update: WeightUpdate) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        handle = self.transport.send(update)
        t1 = time.perf_counter()
        if stageable(update.manifest):
            stage_update(self.weights, self.transport.receive(handle))
        t2 = time.perf_counter()  # the engine's swap: receive and apply
        self.version = apply_update(self.weights, self.transport.receive(handle), self.version)
        _sync(self.device)
        return (t2 - t1) * 1e3, (t1 - t0) * 1e3, (time.perf_counter() - t2) * 1e3

    def close(self) -> None:
        pass


class _RayEngine:
    """A Ray actor holding bf16 weights by HF name, like a rollout engine."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        torch.set_num_threads(2)
        self.weights = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        self.version = 0

    def update_weights(self, handle: WeightUpdate) -> tuple[float, int]:
        t0 = time.perf_counter()
        self.version = apply_update(self.weights, handle, self.version)  # ray.get of each bucket inside
        return (time.perf_counter() - t0) * 1e3, self.version


class RayReceiver:
    name = "ray"

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: str) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=int(3.5 * 2**30))
        self.ray = ray
        self.actor = ray.remote(num_cpus=0)(_RayEngine).remote(shapes)
        self.transport = make_transport("ray")

    def push(self, update: WeightUpdate) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        handle = self.transport.send(update)
        apply_ms, _ = self.ray.get(self.actor.update_weights.remote(handle))
        total_ms = (time.perf_counter() - t0) * 1e3
        self.transport.release(handle)
        return 0.0, total_ms - apply_ms, apply_ms

    def close(self) -> None:
        self.ray.shutdown()


def _subprocess_engine(kind: str, port: int, shapes: dict, device: str, conn: Any) -> None:
    """Receiver process: ``gloo`` (torch.distributed rank 1), ``cuda_ipc`` (handles over a
    pipe) or ``pickle`` (the update itself over a pipe: device buckets travel as host arrays)."""
    torch.set_num_threads(2)
    weights = {k: torch.zeros(s, dtype=torch.bfloat16, device=device) for k, s in shapes.items()}
    version = 0
    if kind == "gloo":
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=1, world_size=2)
        transport = make_transport("broadcast", src=0)
    elif kind == "cuda_ipc":
        transport = make_transport("cuda_ipc", device=device)
    else:
        transport = None  # pickle: what arrives is the update itself, buckets as host arrays
    conn.send("ready")
    while True:
        if kind == "gloo":
            cmd = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(cmd, src=0)
            if not int(cmd):
                break
            update = transport.receive(None)
        else:
            msg = conn.recv()
            if msg is None:
                break
            op, handle = msg
            t0 = time.perf_counter()  # the engine's swap: receive (IPC open) and apply
            update = transport.receive(handle) if transport is not None else handle
            if op == "stage":
                stage_update(weights, update)
                del update
                conn.send("staged")
                continue
        if kind == "gloo":  # the broadcast is received while the engine still generates
            t0 = time.perf_counter()
        version = apply_update(weights, update, version)
        _sync(device)
        del update
        conn.send(((time.perf_counter() - t0) * 1e3, version))
    if kind == "gloo":
        dist.destroy_process_group()


class SubprocessReceiver:
    """An engine in another process, fed over gloo broadcast, CUDA IPC, or a
    pickled update (``pickle``: one hop of what the ``inproc`` transport does
    between actor processes, which takes two: trainer -> driver -> engine)."""

    def __init__(self, kind: str, shapes: dict[str, tuple[int, ...]], device: str) -> None:
        import torch.multiprocessing as mp

        self.name, self.kind, self.device = kind, kind, device
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = ctx.Process(target=_subprocess_engine, args=(kind, port, shapes, device, there))
        self.proc.start()
        if kind == "gloo":
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=2)
            self.transport = make_transport("broadcast", src=0)
        else:
            self.transport = make_transport("cuda_ipc", device=device) if kind == "cuda_ipc" else None
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError(f"{kind} receiver process did not start")

    def _answer(self) -> Any:
        if not self.conn.poll(600):
            raise RuntimeError(f"{self.kind} receiver did not answer in 600 s")
        return self.conn.recv()

    def push(self, update: WeightUpdate) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        stage_ms = 0.0
        if self.kind == "gloo":
            import torch.distributed as dist

            dist.broadcast(torch.ones(1, dtype=torch.int64), src=0)
            self.transport.send(update)
        else:
            handle = self.transport.send(update) if self.transport is not None else update
            staged = self.kind == "cuda_ipc" and stageable(update.manifest)
            if staged:  # the handle goes twice, as two calls do, the apply right behind the stage
                self.conn.send(("stage", handle))
            self.conn.send(("apply", handle))
            if staged:
                self._answer()
                stage_ms = (time.perf_counter() - t0) * 1e3
        apply_ms, _ = self._answer()
        total_ms = (time.perf_counter() - t0) * 1e3
        if self.kind == "cuda_ipc":
            self.transport.release(handle)
        return stage_ms, total_ms - stage_ms - apply_ms, apply_ms

    def close(self) -> None:
        if self.kind == "gloo":
            import torch.distributed as dist

            dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)
            dist.destroy_process_group()
        else:
            self.conn.send(None)
        self.proc.join(timeout=60)


def make_receiver(name: str, shapes: dict, device: str) -> Any:
    if name == "inproc":
        return InProcessReceiver(shapes, device)
    if name == "ray":
        return RayReceiver(shapes, device)
    if name in ("gloo", "cuda_ipc", "pickle"):
        return SubprocessReceiver(name, shapes, device)
    raise ValueError(f"unknown transport {name!r} (inproc, ray, gloo, cuda_ipc, pickle)")


# ---------------------------------------------------------------- the run


def _codec_mix(update: WeightUpdate) -> dict[str, float]:
    """Share of changed elements per (encoding, index codec, value codec)."""
    mix: collections.Counter = collections.Counter()
    for e in update.manifest.entries:
        mix["raw" if e.encoding == "raw" else f"{e.index_codec}+{e.value_codec}"] += e.num_changed
    total = sum(mix.values()) or 1
    return {k: round(v / total, 4) for k, v in mix.most_common()}


def _delta_figures(delta: WeightUpdate) -> dict[str, Any]:
    """What a delta update holds: changed elements, bytes, bytes per changed element, codecs."""
    return {
        "changed_fraction": round(delta.manifest.changed_fraction, 5),
        "num_elements": delta.manifest.num_elements,
        "num_changed": delta.manifest.num_changed,
        "delta_bytes": delta.nbytes,
        "bytes_per_changed_element": round(delta.nbytes / max(1, delta.manifest.num_changed), 3),
        "delta_codec_mix": _codec_mix(delta),
    }


COMPONENTS = ("encode", "stage", "transfer", "apply")


def push_figures(repeats: list[tuple[float, ...]]) -> dict[str, Any]:
    """One transport's pushes of one kind, from one ``(encode, stage, transfer,
    apply, whole)`` ms tuple per repeat (``whole``: the encode and the push in
    one timed span). The headline is the median whole push, ``median_low``, so
    it is one measured repeat; beside it each component's minimum, each from
    whichever repeat was fastest at it, and their sum: a lower bound no single
    push need have reached."""
    assert repeats, "at least one repeat"
    wholes = [t[4] for t in repeats]
    paused = [t[3] for t in repeats]  # the engine's one-step swap: receive + apply
    minima = {name: min(t[i] for t in repeats) for i, name in enumerate(COMPONENTS)}
    return {
        "push_ms_median": round(statistics.median_low(wholes), 2),
        "push_ms_min": round(min(wholes), 2), "push_ms_max": round(max(wholes), 2),
        "push_ms_repeats": [round(w, 2) for w in wholes],
        "component_min_ms": {name: round(v, 2) for name, v in minima.items()},
        "sum_of_component_minima_ms": round(sum(minima.values()), 2),
        # the encode, the stage and the control messages run while the engines generate
        "paused_ms_median": round(statistics.median_low(paused), 2),
        "paused_ms_min_max": [round(min(paused), 2), round(max(paused), 2)],
    }


def default_figures(out: dict[str, Any], transport: str, device: str) -> dict[str, Any]:
    """What ``sync.mode``'s default (``auto``) pushes over bench ``transport``
    from weights on ``device``, and that kind's whole push and engine pause."""
    mode = mode_for(CONFIG_TRANSPORT[transport], device)
    return {"mode": mode, "as_transport": CONFIG_TRANSPORT[transport], "is_faster": mode == out["faster"],
            "push_ms_median": out[mode]["push_ms_median"], "paused_ms_median": out[mode]["paused_ms_median"]}


def machine(device: str) -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "device": device,
            # other processes share this host: the load says how much CPU this run really had
            "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]}
    try:
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, StopIteration, ValueError):
        pass
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def copy_limit(nbytes: int, device: str) -> dict[str, Any]:
    """The floor under a full push: one device-to-device copy of its bytes
    (each byte read once and written once), timed with CUDA events."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    del src, dst
    return {"bytes": nbytes, "copy_ms_median": round(ms, 3),
            "read_plus_write_TB_s": round(2 * nbytes / (ms * 1e-3) / 1e12, 2),
            "what": "a full push moves its bytes once into the engine: this copy is its limit"}


def run(small: bool, device: str, transports: list[str], bucket_bytes: int, repeat: int = 1,
        model_params: str = "bf16", settle_s: float = 1.0, shape: str = "qwen2.5-0.5b") -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    with torch.device(device):  # initialise where it will live: much faster on a GPU
        if shape == "smollm2-135m" and not small:  # the real model's shape: a run's push, benched alone
            from bench.trainer_step import SMOLLM2_135M

            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_135M))
        else:
            model = transformers.Qwen2ForCausalLM(model_config(small))

    def adamw(params):
        return torch.optim.AdamW(params, lr=LRS[0], weight_decay=0.0)

    if model_params == "bf16":
        # fp32 main params from the fp32 init, then bf16 model params: the main
        # params sit anywhere between bf16 values, as after many steps (from
        # bf16-rounded main params a first small step would change far fewer elements)
        opt: Any = MainParamsOptimizer(model.parameters(), adamw, torch.float32)
        model.to(torch.bfloat16)
    else:
        opt = adamw(model.parameters())
    weights = model.state_dict()
    shapes = engine_shapes(weights)
    receivers = [make_receiver(t, shapes, device) for t in transports]
    sender = WeightSender(mode="delta", bucket_bytes=bucket_bytes, dtype=torch.bfloat16)
    try:
        first = sender.encode(weights, 1)  # every receiver starts from the same base
        for r in receivers:
            r.push(first)
        del first
        version = 1
        if device.startswith("cuda"):
            # GPU kernels load on first use (tens of ms): run both paths once unmeasured
            version += 1
            optimizer_step(model, opt, LRS[0], seed=version, device=device)
            warm = [sender.encode(weights, version)]
            sender.force_full()
            warm.append(sender.encode(weights, version))
            for update in warm:
                for r in receivers:
                    r.push(update)
            del warm, update
        runs = []
        for lr in LRS:
            version += 1
            optimizer_step(model, opt, lr, seed=version, device=device)
            # per transport and kind, one (encode, stage, transfer, apply, whole push) in ms per repeat
            timings: dict[str, dict[str, list[tuple[float, ...]]]] = {
                r.name: {"delta": [], "full": []} for r in receivers}
            row: dict[str, Any] = {"lr": lr, "version": version}
            # delta and full alternate within each repeat, so a slow spell on
            # this shared host lands on both kinds rather than on one of them
            for _ in range(repeat):
                for r in receivers:  # every push starts from the same base (the last version)
                    for kind in ("delta", "full"):
                        if kind == "full":
                            sender.force_full()  # the same version, as a full push (the delta stays undoable)
                        time.sleep(settle_s)
                        # one span per push: encode, then the push itself (stage, transfer, apply)
                        t0 = time.perf_counter()
                        update = sender.encode(weights, version)
                        _sync(device)
                        encode_ms = (time.perf_counter() - t0) * 1e3
                        parts = r.push(update)
                        whole_ms = (time.perf_counter() - t0) * 1e3
                        timings[r.name][kind].append((encode_ms, *parts, whole_ms))
                        if kind == "delta" and "delta_bytes" not in row:
                            row.update(_delta_figures(update))
                        elif kind == "full":
                            row["full_bytes"] = update.nbytes
                        del update
                    undo = sender.revert_update()  # back to the base on this receiver (untimed)
                    assert undo is not None, "a delta followed by a full push of its version stays undoable"
                    r.push(undo)
                    del undo
            update = sender.encode(weights, version)  # every receiver on this version for the next step
            for r in receivers:
                r.push(update)
            del update
            encodes = {kind: [t[0] for by_kind in timings.values() for t in by_kind[kind]]
                       for kind in ("delta", "full")}
            # shared host: the fastest encode of the repeats is the closest to the uncontended cost
            row["encode_ms_min"] = {k: round(min(v), 2) for k, v in encodes.items()}
            row["encode_ms_max"] = {k: round(max(v), 2) for k, v in encodes.items()}
            row["transports"] = {}
            for name, by_kind in timings.items():
                out: dict[str, Any] = {kind: push_figures(by_kind[kind]) for kind in ("full", "delta")}
                out["delta_over_full"] = round(out["delta"]["push_ms_median"] / out["full"]["push_ms_median"], 3)
                out["faster"] = "full" if out["full"]["push_ms_median"] < out["delta"]["push_ms_median"] else "delta"
                out["default"] = default_figures(out, name, device)
                row["transports"][name] = out
            runs.append(row)
            print(json.dumps({"progress": f"lr={lr}", **{k: row[k] for k in ("changed_fraction", "delta_bytes")}}),
                  flush=True, file=__import__("sys").stderr)
    finally:
        for r in receivers:
            r.close()
    limit = copy_limit(runs[-1]["full_bytes"], device) if device.startswith("cuda") else None
    return {
        "benchmark": "weight_sync",
        "copy_limit": limit,
        "machine": machine(device),
        "model": {"shape": "small" if small else {"smollm2-135m": "SmolLM2-135M"}.get(shape, "Qwen2.5-0.5B"),
                  "num_params": sum(p.numel() for p in model.parameters()),
                  "engine_dtype": "bfloat16", "master_dtype": "float32", "optimizer": "AdamW",
                  "model_params_dtype": "bfloat16" if model_params == "bf16" else "float32",
                  "sync_reads": ("bf16 model params written by the optimizer step (Megatron-style fp32 main params, "
                                 "actors/backends/mixed_precision.py, as the torch backend does for a bf16 model): "
                                 "no cast in the sync, for full and delta alike") if model_params == "bf16" else
                                ("fp32 params: full and delta both cast to bf16 inside the sync")},
        "native_kernels": codec.choose("cpu", 2) == "c",  # the C delta path (sync.codec.choose)
        "sync_threads": pool.NUM_THREADS,
        "bucket_bytes": bucket_bytes,
        "repeat": repeat,
        "timing": ("each repeat, per transport: the delta and then the full push of the same version from "
                   "the same base, each one timed span (encode + stage + transfer + apply) after the settle "
                   "pause, then the delta taken back untimed. push_ms_median: the median whole push over "
                   "the repeats (median_low: a measured push), with push_ms_min / push_ms_max; "
                   "component_min_ms: each component's fastest repeat (not one push), and "
                   "sum_of_component_minima_ms their sum, a composite lower bound; paused_ms_*: the "
                   "receive + apply of the same repeat, the engine's one-step swap; delta_over_full and faster from the "
                   "push medians; default: the kind sync.mode's default (auto, sync.auto.mode_for) pushes over "
                   "the transport (as_transport: the run's transport it stands for) with its push and pause"),
        "settle_s": settle_s,
        "settle": ("pause before every timed encode and push, full and delta alike: Ray frees the previous "
                   "push's objects in the background, which otherwise lands on the next timed step"),
        "runs": runs,
        "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny model for a quick run")
    p.add_argument("--shape", choices=("qwen2.5-0.5b", "smollm2-135m"), default="qwen2.5-0.5b",
                   help="the model's shape (smollm2-135m: the real-model runs' push, to set beside their sync)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: inproc on the GPU and CUDA IPC)")
    p.add_argument("--transports", default=None,
                   help="comma list of inproc, ray, gloo, cuda_ipc, pickle; "
                        "default inproc,ray,gloo on cpu, inproc,cuda_ipc,pickle on cuda")
    p.add_argument("--bucket-mib", type=int, default=64, help="payload bucket size")
    p.add_argument("--repeat", type=int, default=5,
                   help="time each push this many times (the median whole push is the headline; odd counts "
                        "give a true median)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="pause before each timed encode and push (lets Ray finish freeing the last push)")
    p.add_argument("--model-params", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: mixed precision, the sync reads bf16 model params; fp32: the sync casts")
    args = p.parse_args(argv)
    default = "inproc,cuda_ipc,pickle" if args.device.startswith("cuda") else "inproc,ray,gloo"
    transports = (args.transports or default).split(",")
    torch.set_num_threads(os.cpu_count() or 1)
    result = run(args.small, args.device, transports, args.bucket_mib << 20, max(1, args.repeat), args.model_params,
                 args.settle_s, args.shape)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
