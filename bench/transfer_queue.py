"""TransferQueue benchmark: samples/s and get latency, in-process vs Ray vs ray.util.queue.

    python -m bench.transfer_queue [--num-batches 16] [--latency-rounds 60] [--repeats 3]
                                   [--groups-per-put 1] [--num-storage-units 1] [--out PATH]

Workload: batches of 256 samples, each a 128-token prompt and a 1,024-token
response (ids, log-probs and per-token versions), in GRPO groups of 8.
Samples are built before timing starts; producers and consumers are asyncio
tasks in this process (the rollout and trainer sides), so every deployment
pays its own encode / transport / decode costs on the same two cores.

    throughput   4 producers put groups of 8; 2 consumers get batches of 256,
                 read every sample (``batch.samples``: Python lists, like the
                 Sample objects ray.util.queue hands back) and ack.
                 samples/s = samples delivered / wall time. The Ray deployment and
                 ray.util.queue take turns, ``--repeats`` times each, so both see the
                 same load on the shared box; samples_per_s is the median of the
                 turns (``samples_per_s_runs``: every turn, in order).
                 ``ray_2_units``: the Ray deployment with two storage units
                 instead of ``--num-storage-units``, one turn after each pair.
                 ``samples_per_s_arrays``: the same, but the consumer wants token
                 arrays: ``batch.column(...)`` here (built from the samples), and
                 ``np.array(list)`` per field on ray.util.queue's Sample objects.
    latency      one batch of 256 is put and made ready, then ``get`` is timed
                 (``get_ms``, wall clock; ``get_cpu_ms``, this thread's CPU time,
                 which a busy machine's preemptions do not inflate);
                 ``get_samples_ms`` adds turning it into Sample objects. For ray.util.queue the get (``get_nowait_batch``)
                 already returns Sample objects.

ray.util.queue.Queue runs with its batch API (``put_nowait_batch`` /
``get_nowait_batch``, polling when empty or full), its fastest use. Each
producer puts one GRPO group per call on both queues (``--groups-per-put``
changes that for both alike). Everything runs on the process's one loop
(``loop.run``: uvloop when installed, as every asyncrl process), both queues alike.
Prints one JSON object and writes it to ``bench/results/transfer_queue_cpu.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

import loop
from transfer_queue import EndOfStream, Sample, TransferQueue, TransferQueueConfig

BATCH = 256
GROUP = 8
GROUPS_PER_PUT = 1  # --groups-per-put: both queues get the same put granularity
# --num-storage-units: one on this 2-core host, where a second storage actor (one
# more process, a read and a delete per unit per batch) costs more than it spreads;
# ``ray_2_units`` measures the Ray deployment with two in the same run.
NUM_STORAGE_UNITS = 1
PROMPT_TOKENS = 128
RESPONSE_TOKENS = 1024
NUM_PRODUCERS = 4
NUM_CONSUMERS = 2
CAPACITY = 4 * BATCH
POLL_S = 0.001


def make_samples(n: int, tag: str) -> list[Sample]:
    """``n`` distinct samples sharing token lists (building them is not what we measure)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS).tolist()
    response = rng.integers(0, 150_000, RESPONSE_TOKENS).tolist()
    logprobs = (-rng.random(RESPONSE_TOKENS)).astype(np.float32).tolist()
    versions = [3] * RESPONSE_TOKENS
    # Each sample gets its own lists (sharing the int objects): pickle memoizes a
    # list it has seen, which would flatter ray.util.queue.
    return [
        Sample(uid=f"{tag}{i}", group_id=f"{tag}g{i // GROUP}", prompt_ids=list(prompt), response_ids=list(response),
               rollout_logprobs=list(logprobs), token_versions=list(versions), reward=1.0, finish_reason="stop")
        for i in range(n)
    ]  # fmt: skip


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {"p50": round(float(np.percentile(ms, 50)), 3), "p99": round(float(np.percentile(ms, 99)), 3)}


# ----------------------------------------------------------------- TransferQueue
def arrays_from_samples(samples: list[Sample]) -> int:
    """What a trainer does with Sample objects: token lists -> numpy arrays."""
    n = 0
    for s in samples:
        arrays = (np.array(s.prompt_ids, np.int32), np.array(s.response_ids, np.int32),
                  np.array(s.rollout_logprobs, np.float32), np.array(s.token_versions, np.int32))  # fmt: skip
        n += arrays[1].size > 0
    return n


async def tq_throughput(tq: TransferQueue, samples: list[Sample], arrays: bool = False) -> float:
    chunks = [samples[i : i + GROUP * GROUPS_PER_PUT] for i in range(0, len(samples), GROUP * GROUPS_PER_PUT)]
    delivered = [0]

    async def produce(p: int) -> None:
        for chunk in chunks[p::NUM_PRODUCERS]:
            await tq.put(chunk)

    async def consume(c: int) -> None:
        while True:
            try:
                batch = await tq.get(f"trainer-{c}", BATCH, sampler="grpo_group", group_size=GROUP)
            except EndOfStream:
                return
            if arrays:  # the trainer reads token arrays straight from storage (no lists)
                delivered[0] += sum(a.size > 0 for a in batch.column("response_ids"))
                assert len(batch.column("prompt_ids")) == len(batch.column("rollout_logprobs")) == len(batch)
            else:
                delivered[0] += sum(len(s.response_ids) > 0 for s in batch.samples)
            await tq.ack(batch.batch_id)

    t0 = time.perf_counter()
    consumers = [asyncio.create_task(consume(c)) for c in range(NUM_CONSUMERS)]
    await asyncio.gather(*(produce(p) for p in range(NUM_PRODUCERS)))
    await tq.close()
    await asyncio.gather(*consumers)
    elapsed = time.perf_counter() - t0
    assert delivered[0] == len(samples), (delivered[0], len(samples))
    return len(samples) / elapsed


async def tq_latency(tq: TransferQueue, rounds: int) -> dict[str, Any]:
    get_s, cpu_s, samples_s = [], [], []
    for r in range(rounds):
        await tq.put(make_samples(BATCH, f"lat{r}-"))
        c0, t0 = time.thread_time(), time.perf_counter()
        batch = await tq.get("trainer", BATCH, sampler="grpo_group", group_size=GROUP, timeout_s=0)
        t1, c1 = time.perf_counter(), time.thread_time()
        assert len(batch.samples) == BATCH
        t2 = time.perf_counter()
        await tq.ack(batch.batch_id)
        del batch  # freeing its Python lists is the consumer's cost, not the next get's
        get_s.append(t1 - t0)
        cpu_s.append(c1 - c0)
        samples_s.append(t2 - t0)
    return {
        "get_ms": percentiles_ms(get_s),
        "get_cpu_ms": percentiles_ms(cpu_s),
        "get_samples_ms": percentiles_ms(samples_s),
    }


def tq_cfg(deployment: str, num_storage_units: int | None = None) -> TransferQueueConfig:
    return TransferQueueConfig(
        capacity=CAPACITY, num_storage_units=num_storage_units or NUM_STORAGE_UNITS, lease_s=600.0, deployment=deployment
    )


async def tq_rate(deployment: str, samples: list[Sample], num_storage_units: int | None = None) -> float:
    tq = await TransferQueue.create(tq_cfg(deployment, num_storage_units))
    rate = await tq_throughput(tq, samples)
    await tq.shutdown()
    return rate


async def bench_tq(deployment: str, num_batches: int, rounds: int) -> dict[str, Any]:
    cfg = tq_cfg(deployment)
    tq = await TransferQueue.create(cfg)
    latency = await tq_latency(tq, rounds)
    await tq.shutdown()
    tq = await TransferQueue.create(cfg)
    await tq_throughput(tq, make_samples(BATCH, "warm-"))  # warm-up: actors, imports, caches
    await tq.shutdown()
    tq = await TransferQueue.create(cfg)
    rate = await tq_throughput(tq, make_samples(num_batches * BATCH, "s"))
    await tq.shutdown()
    tq = await TransferQueue.create(cfg)
    rate_arrays = await tq_throughput(tq, make_samples(num_batches * BATCH, "a"), arrays=True)
    await tq.shutdown()
    return {"samples_per_s": round(rate, 1), "samples_per_s_arrays": round(rate_arrays, 1), **latency}


# ------------------------------------------------------------ ray.util.queue
async def rq_throughput(samples: list[Sample], arrays: bool = False) -> float:
    from ray.util.queue import Empty, Full, Queue

    q = Queue(maxsize=CAPACITY)
    chunks = [samples[i : i + GROUP * GROUPS_PER_PUT] for i in range(0, len(samples), GROUP * GROUPS_PER_PUT)]
    done = asyncio.Event()
    delivered = [0]

    async def produce(p: int) -> None:
        for chunk in chunks[p::NUM_PRODUCERS]:
            while True:
                try:
                    await q.actor.put_nowait_batch.remote(chunk)
                    break
                except Full:
                    await asyncio.sleep(POLL_S)

    async def consume() -> None:
        while not (done.is_set() and delivered[0] >= len(samples)):
            try:
                batch = await q.actor.get_nowait_batch.remote(BATCH)
            except Empty:
                await asyncio.sleep(POLL_S)
                continue
            if arrays:
                delivered[0] += arrays_from_samples(batch)
            else:
                delivered[0] += sum(len(s.response_ids) > 0 for s in batch)

    t0 = time.perf_counter()
    consumers = [asyncio.create_task(consume()) for _ in range(NUM_CONSUMERS)]
    await asyncio.gather(*(produce(p) for p in range(NUM_PRODUCERS)))
    done.set()
    await asyncio.gather(*consumers)
    elapsed = time.perf_counter() - t0
    q.shutdown()
    assert delivered[0] == len(samples)
    return len(samples) / elapsed


async def rq_latency(rounds: int) -> dict[str, Any]:
    from ray.util.queue import Queue

    q = Queue(maxsize=CAPACITY)
    get_s = []
    for r in range(rounds):
        await q.actor.put_nowait_batch.remote(make_samples(BATCH, f"lat{r}-"))
        t0 = time.perf_counter()
        batch = await q.actor.get_nowait_batch.remote(BATCH)
        get_s.append(time.perf_counter() - t0)
        assert len(batch) == BATCH
    q.shutdown()
    return {"get_ms": percentiles_ms(get_s), "get_samples_ms": percentiles_ms(get_s)}


async def bench_rq(num_batches: int, rounds: int) -> dict[str, Any]:
    latency = await rq_latency(rounds)
    await rq_throughput(make_samples(BATCH, "warm-"))
    rate = await rq_throughput(make_samples(num_batches * BATCH, "s"))
    rate_arrays = await rq_throughput(make_samples(num_batches * BATCH, "a"), arrays=True)
    return {"samples_per_s": round(rate, 1), "samples_per_s_arrays": round(rate_arrays, 1), **latency}


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), no GPU, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
        f"shared with other jobs: load average {load[0]:.1f} at start"
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    result: dict[str, Any] = {
        "bench": "transfer_queue",
        "machine": machine(),
        "workload": {
            "batch_size": BATCH, "group_size": GROUP, "groups_per_put": GROUPS_PER_PUT, "prompt_tokens": PROMPT_TOKENS,
            "response_tokens": RESPONSE_TOKENS, "num_producers": NUM_PRODUCERS, "num_storage_units": NUM_STORAGE_UNITS,
            "num_consumers": NUM_CONSUMERS, "capacity": CAPACITY,
            "throughput_samples": args.num_batches * BATCH, "latency_rounds": args.latency_rounds,
        },  # fmt: skip
    }
    result["local"] = await bench_tq("local", args.num_batches, args.latency_rounds)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result["ray"] = await bench_tq("ray", args.num_batches, args.latency_rounds)
        result["ray_util_queue"] = await bench_rq(args.num_batches, args.latency_rounds)
        # The runs above are the first turn; more turns, alternating, so both sides see the same load.
        runs = {side: [result[side]["samples_per_s"]] for side in ("ray", "ray_util_queue")}
        runs["ray_2_units"] = []
        for r in range(args.repeats):
            if r:
                runs["ray"].append(await tq_rate("ray", make_samples(args.num_batches * BATCH, f"r{r}-")))
                runs["ray_util_queue"].append(await rq_throughput(make_samples(args.num_batches * BATCH, f"q{r}-")))
            runs["ray_2_units"].append(await tq_rate("ray", make_samples(args.num_batches * BATCH, f"u{r}-"), 2))
        result["ray_2_units"] = {}
        for side, rates in runs.items():
            result[side]["samples_per_s"] = round(float(np.median(rates)), 1)
            result[side]["samples_per_s_runs"] = [round(x, 1) for x in rates]
    finally:
        if started:
            ray.shutdown()
    ray_rate, rq_rate = result["ray"]["samples_per_s"], result["ray_util_queue"]["samples_per_s"]
    result["ratio_ray_vs_ray_util_queue"] = round(ray_rate / rq_rate, 2)
    result["ratio_ray_vs_ray_util_queue_arrays"] = round(
        result["ray"]["samples_per_s_arrays"] / result["ray_util_queue"]["samples_per_s_arrays"], 2
    )
    result["ratio_ray_2_units_vs_ray_util_queue"] = round(result["ray_2_units"]["samples_per_s"] / rq_rate, 2)
    result["ratio_local_vs_ray_util_queue"] = round(result["local"]["samples_per_s"] / rq_rate, 2)
    result["goals"] = {
        "ray_at_least_5x_ray_util_queue": ray_rate >= 5 * rq_rate,
        "local_get_p99_under_1ms": result["local"]["get_ms"]["p99"] < 1.0,
        "local_get_cpu_p99_under_1ms": result["local"]["get_cpu_ms"]["p99"] < 1.0,
    }
    load = os.getloadavg()
    result["load_average_end"] = [round(x, 2) for x in load]
    result["notes"] = (
        "All three run with their producers and consumers in this one process on 2 shared cores, so every "
        "figure is CPU-bound and swings with the other jobs' load (see machine, load_average_end); under load "
        "the samples/s ratio tracks the ratio of CPU spent per sample over all processes. Both Ray sides hand "
        "the consumer real Sample objects: ray.util.queue unpickles them, TransferQueue decodes one msgpack "
        "buffer per storage unit (a uint8 array read in place from the object store) straight into Sample "
        "structs (batch.samples, ~115-185 us per 1k-token sample here: allocating ~2,200 Python ints and "
        "floats; pickle.loads costs the same, so it is the floor for both); batch.column parses only the asked "
        "field. Per batch of 256 the TransferQueue client makes ~12 Ray calls: 8 puts (one call each: the "
        "storage unit keeps the rows whole, unparsed, and has the controller reserve and commit them; the 4 "
        "producers' concurrent puts share a call, so 32 samples each), get_batch, one read per storage unit, "
        "ack; ray.util.queue makes ~47 (32 put_nowait_batch, ~15 get_nowait_batch polls). Profiled on this box "
        "(per-process CPU over 4,096-sample turns; py-spy of the driver; not part of this JSON): a Ray actor "
        "call costs ~1 ms of CPU at each end with no payload (async actor; ~0.7 ms sync) and ~1.3 ms more per "
        "end for a 0.5 MB argument; TransferQueue with two storage units ~680-750 us of CPU per sample in all at "
        "load 2-3 (driver ~330-360, of which decoding Samples and freeing them ~45%, encoding ~10%, Ray call "
        "submission ~17%, the event loop ~10%; each storage unit ~110-120; controller ~85-110; raylet ~20), with "
        "one ~590-610 (one process, read and delete fewer: ~25-30% more samples/s here, see ray_2_units), "
        "ray.util.queue ~1,650-2,200 "
        "(its queue actor ~725-940, driver ~690-870, raylet ~220-310). The 5x goal needs ~330-440 us of CPU "
        "per sample in all, ~180-220 of it the floor of encoding and decoding Python lists in the one driver "
        "process, so it is not reached with Ray calls at ~2 ms of CPU each on these 2 cores."
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-batches", type=int, default=16, help="batches of 256 in the throughput run")
    parser.add_argument("--latency-rounds", type=int, default=60, help="timed gets per deployment")
    parser.add_argument("--repeats", type=int, default=3, help="turns each of Ray and ray.util.queue take (throughput)")
    parser.add_argument("--groups-per-put", type=int, default=1,
                        help="GRPO groups per put call, for every producer of both queues (default 1)")
    parser.add_argument("--num-storage-units", type=int, default=1,
                        help="storage units of both TransferQueue deployments (default 1: see NUM_STORAGE_UNITS)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer_queue_cpu.json"))
    args = parser.parse_args()
    GROUPS_PER_PUT = args.groups_per_put
    NUM_STORAGE_UNITS = args.num_storage_units
    out = loop.run(main(args))  # the project's one loop (uvloop when installed), as every asyncrl process runs
    text = json.dumps(out, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
