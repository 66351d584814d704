"""Fully-async runs with and without ``gc.freeze()`` after each actor's setup, paired.

    python -m bench.gc_freeze                      # the 397k model on the CPU: a smoke test
    python -m bench.gc_freeze --pairs 3 --device cuda --runtime process model.path=... (any
                                                   # bench.async_vs_sync argument)

Every actor process freezes what its setup left alive (``actors/gc_clock.py``): a full
collection then walks only what the run allocated since, instead of every module, the
model's Python objects and the rest of the heap; each collection holds the GIL, so the
engine's decode thread stands still for it. ``ASYNCRL_GC_FREEZE=0`` turns the freeze off;
this bench runs ``bench.async_vs_sync``'s fully-async run (its warm-up untimed) with it on
and off, alternating which goes first from pair to pair, and prints one JSON object:
per run trained tokens/s, engine tokens/s, the rollout process's share of the window in
collections and its full collections; per pair the on / off ratio of trained tokens/s;
``speedup_freeze``: the ratio of the medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from typing import Any

from bench import async_vs_sync, emit

_KEYS = ("tokens_per_s", "engine_tokens_per_s", "rollout_gc_share", "wall_s")


def _run(freeze: bool, seed: int, args: Any) -> dict[str, Any]:
    kept = os.environ.get("ASYNCRL_GC_FREEZE")
    os.environ["ASYNCRL_GC_FREEZE"] = "1" if freeze else "0"  # the actors' processes inherit it
    try:
        one = async_vs_sync._one("fully_async", seed, args.runtime.split(",")[0], args)
    finally:
        if kept is None:
            os.environ.pop("ASYNCRL_GC_FREEZE", None)
        else:
            os.environ["ASYNCRL_GC_FREEZE"] = kept
    engine = one.get("engine", {})
    return {"freeze": freeze, "seed": seed, **{k: one.get(k) for k in _KEYS},
            "gc_collections": engine.get("gc_collections"), "gc_full_collections": engine.get("gc_full_collections"),
            "gc_full_pause_s": engine.get("gc_full_pause_s")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = 3
    if "--pairs" in argv:
        i = argv.index("--pairs")
        pairs = int(argv[i + 1])
        del argv[i:i + 2]
    args = async_vs_sync.parse_args(["--policies", "fully_async", "--no-standalone", *argv])
    runs = []
    for pair in range(pairs):
        for freeze in ((True, False) if pair % 2 == 0 else (False, True)):
            runs.append(_run(freeze, pair, args))
            print(f"[gc_freeze] pair {pair} freeze={freeze}: {runs[-1]['tokens_per_s']:.0f} trained tokens/s",
                  file=sys.stderr)
    on = [r for r in runs if r["freeze"]]
    off = [r for r in runs if not r["freeze"]]
    out = {
        "bench": "gc_freeze", "device": args.device, "runtime": args.runtime, "task": args.task,
        "steps": args.steps, "batch_size": args.batch_prompts * args.n, "overrides": args.overrides,
        "machine": f"{platform.node()} {platform.machine()}", "cpu_count": os.cpu_count(), "pairs": pairs,
        "runs": runs,
        "tokens_per_s_ratio_per_pair": [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in zip(on, off)],
        "speedup_freeze": statistics.median(r["tokens_per_s"] for r in on)
        / statistics.median(r["tokens_per_s"] for r in off),
        "gc_share_median": {"freeze": statistics.median(r["rollout_gc_share"] or 0.0 for r in on),
                            "no_freeze": statistics.median(r["rollout_gc_share"] or 0.0 for r in off)},
    }
    emit(out, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
