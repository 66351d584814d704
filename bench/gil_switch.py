"""The built-in engine's thread beside another thread's Python, by GIL switch interval.

    python -m bench.gil_switch [--duty 0.1] [--intervals-ms 0.5,0.1] [--pairs 3]

A rollout actor's process runs the engine's step thread beside its event loop (scoring,
queue puts, calls). The engine's thread gives the GIL up at every torch call and waits
to get it back; while the other thread's Python holds it, each wait lasts up to the
switch interval (``sys.setswitchinterval``). This measures that on a CPU with the
``tiny`` shape (bench.engine's: a forward of microseconds a layer, so a step is many
short torch calls, as launches are on a GPU): the engine decodes batches of 64
requests x 128 tokens while a thread runs Python (pickling) in 2 ms bursts, busy
``--duty`` of the time; the intervals take turns, ``--pairs`` times each, after one
untimed batch, each round led by a turn with the engine alone (no busy thread). Per
turn: engine tokens/s and the engine thread's off-CPU share of its turns
(``bench.pipeline_report.offcpu_share``). Prints one JSON object: per interval every
turn and the median, and each interval's median tokens/s over the first's and over
the engine's alone. A smoke test of the mechanism on this machine, not a GPU figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time

import torch

import loop
from actors.engines import GenerateRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine
from bench import emit
from bench.engine import build_model
from bench.pipeline_report import offcpu_share

BURST_S = 0.002


def _busy(stop: threading.Event, duty: float) -> None:
    """Python in BURST_S bursts, busy ``duty`` of the time (the GIL held throughout a burst)."""
    work = [{"ids": list(range(64)), "text": "x" * 128} for _ in range(16)]
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < BURST_S:
            pickle.loads(pickle.dumps(work))
        time.sleep(BURST_S * (1 - duty) / duty)


async def _batch(engine: TorchEngine, tag: str) -> float:
    sampling = SamplingParams(temperature=1.0)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(
        request_id=f"{tag}-{i}", prompt_ids=[i % 500 + 1] * 16, max_tokens=128, sampling=sampling)) for i in range(64)))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


async def _turn(engine: TorchEngine, interval_s: float, duty: float, tag: str) -> dict[str, float]:
    """One timed batch at ``interval_s`` beside the busy thread (``duty`` 0: alone)."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop, duty), daemon=True)
    core = engine._core
    if duty > 0:
        busy.start()
    try:
        cpu0, turn0 = core.thread_cpu_s(), core.timing["turn_s"]
        tokens_per_s = await _batch(engine, tag)
        off = offcpu_share(core.timing["turn_s"] - turn0, core.thread_cpu_s() - cpu0)
    finally:
        stop.set()
        if duty > 0:
            busy.join()
    return {"tokens_per_s": round(tokens_per_s, 1), "offcpu_share": round(off or 0.0, 4)}


async def _main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    intervals = [float(x) / 1e3 for x in args.intervals_ms.split(",")]
    kept = sys.getswitchinterval()
    with tempfile.TemporaryDirectory() as d:
        build_model("tiny", d, "cpu", torch.float32)
        engine = TorchEngine(d, device="cpu", max_num_seqs=64, max_model_len=256, overlap_steps=False)
        await engine.setup()
        try:
            await _batch(engine, "warm")
            turns: dict[float, list[dict[str, float]]] = {i: [] for i in intervals}
            alone: list[dict[str, float]] = []
            for p in range(args.pairs):
                alone.append(await _turn(engine, kept, 0.0, f"a{p}"))
                for i in intervals:
                    turns[i].append(await _turn(engine, i, args.duty, f"t{p}-{i}"))
        finally:
            sys.setswitchinterval(kept)
            await engine.close()
    med = {i: statistics.median(t["tokens_per_s"] for t in ts) for i, ts in turns.items()}
    alone_med = statistics.median(t["tokens_per_s"] for t in alone)
    return {
        "bench": "gil_switch", "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                                          "1 torch thread",
        "model_shape": "tiny", "batch": 64, "new_tokens": 128, "busy_duty": args.duty, "busy_burst_ms": BURST_S * 1e3,
        "pairs": args.pairs,
        "alone": {"switch_interval_ms": kept * 1e3, "tokens_per_s_median": alone_med, "turns": alone},
        "intervals_ms": {f"{i * 1e3:g}": {"tokens_per_s_median": med[i],
                                          "offcpu_share_median": statistics.median(t["offcpu_share"] for t in ts),
                                          "turns": ts} for i, ts in turns.items()},
        "tokens_per_s_over_first": {f"{i * 1e3:g}": round(med[i] / med[intervals[0]], 3) for i in intervals},
        "tokens_per_s_over_alone": {f"{i * 1e3:g}": round(med[i] / alone_med, 3) for i in intervals},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duty", type=float, default=0.1, help="share of the time the other thread runs Python")
    p.add_argument("--intervals-ms", default="0.5,0.1", help="switch intervals to compare, the first the baseline")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    if not 0 < args.duty < 1:
        p.error("--duty must be in (0, 1)")
    emit(loop.run(_main(args)), args.out)


if __name__ == "__main__":
    main()
