"""What a rollout actor's put costs it under the ``process`` runtime: the queue is
served from a queue-host process, and every CPU second the put takes on the actor's
event loop is one the engine's thread (same process, same GIL) does not run.

    python -m bench.queue_put [--groups 400] [--group-size 8] [--response-tokens 165] [--repeats 5]

Two ways to put the same finished groups (token fields numpy arrays, as the rollout
actor packs them), taking turns, ``--repeats`` times each, against one queue host:

    put           one call: the group as one msgpack body, registered, stored and
                  committed by the host (what ``TransferQueue.put`` does)
    put_fields    every field through the two-round write: reserve, then the rows
                  pickled with their arrays out of band, then commit (the path
                  ``put`` took before, and ``put_fields`` still takes)

Each turn puts ``--groups`` groups one after the other from this process's loop and
reports the loop thread's CPU microseconds per sample (``time.thread_time``) and the
wall milliseconds per put; the consumer (this process, after the timed window) drains
and acknowledges. Prints one JSON object: per way the median of the turns and every
turn, and ``cpu_ratio`` / ``wall_ratio`` (put_fields over put, > 1: put is cheaper).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

import loop
from actors.runtime import ProcessRuntime
from bench import emit
from contracts.sample import Sample, pack_tokens
from transfer_queue import TransferQueue, TransferQueueConfig
from transfer_queue.codec import ALL_FIELDS
from transfer_queue.served import QueueHost, ServedDeployment, new_secret

SPAWN_IMPORTS_MAIN = False  # the queue host's process needs nothing from this module


def _groups(num: int, size: int, prompt: int, response: int, tag: str) -> list[list[Sample]]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(num):
        out.append([pack_tokens(Sample(
            uid=f"{tag}{g}-{k}", group_id=f"{tag}{g}", prompt_ids=rng.integers(1, 49152, prompt).tolist(),
            response_ids=rng.integers(1, 49152, response).tolist(), rollout_logprobs=(-rng.random(response)).tolist(),
            token_versions=[3] * response, reward=float(k % 2), finish_reason="stop", meta={"answer": str(g)},
            created_s=1.0, finished_s=2.0)) for k in range(size)])
    return out


async def _turn(client: TransferQueue, way: str, groups: list[list[Sample]]) -> dict[str, float]:
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for group in groups:
        if way == "put":
            await client.put(group)
        else:
            await client.put_fields(group, ALL_FIELDS)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    n = sum(len(g) for g in groups)
    while (stats := await client.statistics_async()).pending:  # drained outside the timed window
        batch = await client.get("trainer", min(stats.pending, 256))
        await client.ack(batch.batch_id)
    return {"cpu_us_per_sample": cpu / n * 1e6, "wall_ms_per_put": wall / len(groups) * 1e3}


async def _main(args: argparse.Namespace) -> dict:
    cfg = TransferQueueConfig(capacity=max(4096, 2 * args.groups * args.group_size), num_storage_units=1)
    runtime = ProcessRuntime()
    secret = new_secret()
    host = await runtime.spawn(QueueHost, cfg, secret, name="transfer-queue")
    try:
        client = TransferQueue(cfg, ServedDeployment(await host.address(), secret))
        await _turn(client, "put", _groups(8, args.group_size, args.prompt_tokens, args.response_tokens, "w"))
        await _turn(client, "put_fields", _groups(8, args.group_size, args.prompt_tokens, args.response_tokens, "v"))
        runs: dict[str, list[dict[str, float]]] = {"put": [], "put_fields": []}
        for r in range(args.repeats):
            for way in runs:
                groups = _groups(args.groups, args.group_size, args.prompt_tokens, args.response_tokens, f"{way}{r}-")
                runs[way].append(await _turn(client, way, groups))
        await client.shutdown()
    finally:
        await runtime.shutdown()
    med = {way: {k: statistics.median(t[k] for t in turns) for k in turns[0]} for way, turns in runs.items()}
    return {
        "bench": "queue_put",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}",
        "groups": args.groups, "group_size": args.group_size, "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens, "repeats": args.repeats,
        "median": {way: {k: round(v, 2) for k, v in m.items()} for way, m in med.items()},
        "turns": {way: [{k: round(v, 2) for k, v in t.items()} for t in turns] for way, turns in runs.items()},
        "cpu_ratio": round(med["put_fields"]["cpu_us_per_sample"] / med["put"]["cpu_us_per_sample"], 3),
        "wall_ratio": round(med["put_fields"]["wall_ms_per_put"] / med["put"]["wall_ms_per_put"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=400)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=62)
    p.add_argument("--response-tokens", type=int, default=165)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    result = loop.run(_main(args))
    emit(result, args.out)


if __name__ == "__main__":
    main()
