"""Admission: one window budget per sync, its four modes, and the staleness it implies."""

from __future__ import annotations

import asyncio
import random

import pytest

from policies.admission import Admission, window_budget


@pytest.mark.parametrize(
    ("mode", "b", "req", "k", "s", "expected"),
    [
        ("on-policy", 64, 1, 1, 0.0, 64),
        ("stream off-policy", 64, 1, 4, 0.0, 256),
        ("async, stale samples", 64, 1, 2, 0.5, 192),
        ("async, partial rollouts", 64, 2, 1, 1.0, 256),
    ],
)
def test_window_budget_matches_the_formula_in_each_mode(mode, b, req, k, s, expected):
    assert window_budget(b, req, k, s) == expected


def test_window_budget_rejects_bad_values():
    with pytest.raises(ValueError):
        window_budget(0, 1, 1, 0.0)
    with pytest.raises(ValueError):
        window_budget(8, 1, 1, -0.1)


@pytest.mark.asyncio
async def test_on_policy_admits_exactly_one_batch_per_window():
    adm = Admission(window_budget(8, 1, 1, 0.0))
    for _ in range(2):
        assert await adm.acquire(4)
    blocked = asyncio.create_task(adm.acquire(4))
    await asyncio.sleep(0)
    assert not blocked.done()
    await adm.open_window(outstanding=0)  # the batch was trained, weights synced
    assert await asyncio.wait_for(blocked, 5)


@pytest.mark.asyncio
async def test_carried_samples_count_against_the_next_window():
    adm = Admission(window_budget(8, 1, 1, 1.0))  # budget 16
    for _ in range(4):
        assert await adm.acquire(4)
    await adm.open_window(outstanding=12)  # only 4 were trained
    assert adm.can_admit(4) and not adm.can_admit(8)


@pytest.mark.asyncio
async def test_release_lets_a_dropped_group_be_replaced():
    adm = Admission(8)
    assert await adm.acquire(8)
    waiter = asyncio.create_task(adm.acquire(4))
    await asyncio.sleep(0)
    assert not waiter.done()
    await adm.release(4)
    assert await asyncio.wait_for(waiter, 5)


@pytest.mark.asyncio
async def test_close_wakes_waiters_with_false():
    adm = Admission(4)
    assert await adm.acquire(4)
    waiter = asyncio.create_task(adm.acquire(4))
    await asyncio.sleep(0)
    await adm.close()
    assert await asyncio.wait_for(waiter, 5) is False


@pytest.mark.asyncio
async def test_staleness_bound_holds_under_random_interleavings():
    """Random rollout/trainer speeds and completion order: the admitted-but-untrained
    count never exceeds the window budget, no trained sample is staler than
    max_staleness (older ones are dropped, counted), and nothing is lost."""
    for seed in range(30):
        rng = random.Random(seed)
        batch, n, k, s = 8, 4, rng.choice([1, 2]), rng.choice([0.0, 0.5, 1.0, 2.0])
        max_staleness = rng.choice([0, 1, 2, 4])
        budget = window_budget(batch, 1, k, s)
        adm = Admission(budget)
        version, queue, in_flight = 0, [], []
        admitted = trained = dropped = max_lag = 0
        for _ in range(600):
            r = rng.random()
            if r < 0.4 and adm.can_admit(n):
                await adm.acquire(n)
                admitted += n
                in_flight.append(version)  # a group sampled by the current weights
            elif r < 0.7 and in_flight:
                queue.extend([in_flight.pop(rng.randrange(len(in_flight)))] * n)
            elif len(queue) >= batch:
                fresh = [v for v in queue if version - v <= max_staleness]
                if len(fresh) < len(queue):
                    dropped += len(queue) - len(fresh)
                    await adm.release(len(queue) - len(fresh))
                    queue = fresh
                if len(queue) < batch:
                    continue
                step, queue = queue[:batch], queue[batch:]
                max_lag = max(max_lag, max(version - v for v in step))
                trained += batch
                version += 1
                if version % k == 0:
                    await adm.open_window(outstanding=len(queue) + n * len(in_flight))
            outstanding = len(queue) + n * len(in_flight)
            assert outstanding <= budget, (seed, outstanding, budget)
            assert admitted == trained + dropped + outstanding
        assert max_lag <= max_staleness, (seed, k, s, max_lag)
