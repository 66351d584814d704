"""A discrete-event (fluid) model of the schedules asyncrl runs, for ``bench.simulate``.

    prompts ─► dispatcher ─► engine × R  (continuous batching: every running sequence
                  │            │          gains one token per decode step; a step takes
                  │            │          decode_s(batch); admitting sequences stalls the
                  │            │          engine for their prefill, a finished one for its
                  │            │          result's handling, after which it is delivered)
                  │            ▼
                  │      finished groups ─► queue ─► trainer (T GPUs, data parallel)
                  │                                     │ step: fixed + per-token / (T · eff)
                  ▼                                     ▼   + the driver's overhead
      admission (the schedule's rule)        weight push every K steps: the trainer
      unblocked by: a push, a drop            waits for it (or its encode only, with
                                              overlap), engines pause for its apply
                                              and treat in-flight samples per mode;
                                              every E steps, once the push is done, an
                                              evaluation: held-out prompts on the
                                              engines, the trainer waits for them

Schedules: ``sync`` (generate B, train, push), ``one_step_off`` (generate batch k+1
while training batch k; the whole push follows both), ``fully_async`` (admission window
of ``policies.admission``: ``ceil((1 + s) · K · B)`` samples per sync window, carried
ones included (every sample of an unfinished group, queued or being trained, as
``policies.fully_async`` counts them at a push); the trainer drops samples older than
``max_staleness`` versions; the rollout keeps generating through evaluations). In-flight mode at a push (fully-async):
``abort`` (running samples are aborted, resubmitted to their engine behind the requests
waiting there and re-prefilled on prompt + partial), ``keep`` (only the pause),
``recompute`` (re-prefill in place).

Time is fluid between events: a running sequence advances ``dt / decode_s(batch)``
tokens, so an event happens only when a sequence finishes or is delivered, one is
admitted, the trainer starts or ends, a push pauses or resumes the engines, or an
evaluation ends. Rollout and trainer sharing one GPU and host slow each other
(``Interference``): a decode step takes ``max(decode_floor_s, decode_s(batch))`` times the
engine's factor, one while the trainer is busy and one while it is idle; a train step its
time times the trainer's, by whether the rollout is busy when it starts. All 1 (the default):
separate devices, each part at its standalone speed.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from typing import Literal

__all__ = ["Inputs", "Interference", "Schedule", "Result", "LengthDist", "simulate"]

INF = float("inf")


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Response lengths, capped at ``max_len``, by one of two laws:

    - the tasks' truncated Pareto, ``min(max_len, floor(min_len · u^(-1/alpha)))``
      (``alpha = inf`` gives a fixed ``min_len``): a model that answers the task's
      target, whose length the task draws;
    - with ``continue_prob`` set, geometric: ``P(L >= k) = continue_prob^(k-1)``, a model
      that stops with the same probability after every token (an untrained or free-running
      one), the law of largest entropy for a given mean.
    """

    min_len: float
    alpha: float
    max_len: int
    continue_prob: float | None = None

    @classmethod
    def fixed(cls, length: int) -> LengthDist:
        return cls(float(length), INF, length)

    @classmethod
    def with_mean(cls, mean: float, alpha: float, max_len: int) -> LengthDist:
        """The distribution of this tail and cap whose mean is ``mean`` (``min_len`` solved by bisection)."""
        if not 1 <= mean <= max_len:
            raise ValueError(f"mean response length {mean} outside [1, max_len={max_len}]")
        lo, hi = 1.0, float(max_len)
        for _ in range(60):
            mid = (lo + hi) / 2
            if cls(mid, alpha, max_len).mean() < mean:
                lo = mid
            else:
                hi = mid
        return cls(lo, alpha, max_len)

    @classmethod
    def geometric(cls, mean: float, max_len: int) -> LengthDist:
        """The geometric law with this cap whose mean is ``mean`` (``continue_prob`` by bisection)."""
        if not 1 <= mean <= max_len:
            raise ValueError(f"mean response length {mean} outside [1, max_len={max_len}]")
        lo, hi = 0.0, 1.0
        for _ in range(80):
            mid = (lo + hi) / 2
            if cls(1.0, INF, max_len, mid).mean() < mean:
                lo = mid
            else:
                hi = mid
        return cls(1.0, INF, max_len, lo)

    def mean(self) -> float:
        if self.continue_prob is not None:
            q = self.continue_prob
            return float(self.max_len) if q >= 1.0 else (1.0 - q ** self.max_len) / (1.0 - q)
        if math.isinf(self.alpha):
            return float(min(self.max_len, math.floor(self.min_len)))
        # E[min(M, floor(X))] = sum_{k>=1} P(min(M, floor X) >= k) = sum_{k=1..M} P(X >= k)
        return float(sum(min(1.0, (self.min_len / k) ** self.alpha) for k in range(1, self.max_len + 1)))

    def sample(self, rng: random.Random) -> int:
        if self.continue_prob is not None:
            q = self.continue_prob
            if q <= 0.0 or q >= 1.0:
                return 1 if q <= 0.0 else self.max_len
            return max(1, min(self.max_len, 1 + int(math.log(1.0 - rng.random()) / math.log(q))))
        if math.isinf(self.alpha):
            return max(1, min(self.max_len, int(self.min_len)))
        u = 1.0 - rng.random()
        return max(1, min(self.max_len, int(math.floor(self.min_len * u ** (-1.0 / self.alpha)))))


@dataclasses.dataclass(frozen=True)
class Interference:
    """How the loop slows each part against its standalone speed (all 1: no slowdown).

    ``bench.simulate_validate`` fits these on paired standalone and in-loop clocks of a few
    kept runs (``bench/results/simulate/simulate_interference.json``)."""

    decode_floor_s: float = 0.0
    """A decode step in the loop takes at least this long, whatever its batch: the rollout
    process's host work per step (its Python and launches), which a standalone engine
    bench at 64 rows and more does not reach."""
    engine_alone: float = 1.0
    """Decode step in the loop over ``max(floor, standalone step)`` while the trainer is idle."""
    engine_shared: float = 1.0
    """The same while the trainer is busy (one GPU: the two processes' kernels take turns)."""
    trainer_alone: float = 1.0
    """Train step in the loop over its standalone step, started with the rollout idle."""
    trainer_shared: float = 1.0
    """The same, started while the rollout is generating."""


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Measured (or scaled) costs and the workload; every time in seconds."""

    decode_base_s: float
    """Decode step time of one engine at batch 0 (launch and weight-read bound)."""
    decode_per_seq_s: float
    """Extra decode step time per running sequence."""
    prefill_per_token_s: float
    """Engine time to prefill one token (prompt or resumed partial)."""
    train_fixed_s: float
    """Trainer step time that does not shrink with tokens (optimizer, launches)."""
    train_per_token_s: float
    """Trainer time per trained token (prompt + response) on one GPU."""
    push_s: float
    """A weight push as the trainer waits for it without overlap (encode .. apply)."""
    push_paused_s: float
    """The part of a push the engines spend paused (transfer + apply)."""
    push_encode_s: float
    """The part the trainer waits for with ``overlap_push``."""
    lengths: LengthDist
    prompt_len: int
    samples_per_step: int
    group_size: int = 1
    step_overhead_s: float = 0.0
    """Driver time per trainer step outside the train call (batch fetch, reports)."""
    num_rollout: int = 1
    num_trainer: int = 1
    dp_efficiency: float = 1.0
    """Trainer scaling: T GPUs give T · dp_efficiency times one GPU's token rate."""
    max_running: int = 1 << 30
    """Sequences one engine runs at once (KV budget)."""
    interference: Interference = Interference()
    resume_overhead_s: float = 0.0
    """Per aborted sample, before it can be resubmitted (abort mode)."""
    prefill_per_seq_s: float = 0.0
    """Engine time to prefill one sequence besides its tokens (the host's work per sequence,
    which is most of a prefill for a small model); a resumed partial pays it again."""
    sample_overhead_s: float = 0.0
    """Engine time per finished sample outside its prefill and decode steps (the rollout's
    handling of a result), stalling that engine like a prefill."""
    eval_every: int = 0
    """An in-loop evaluation after every ``eval_every``-th trainer step (0: none), once that
    step's push has finished, the last step excepted (as ``policies.base`` runs them)."""
    eval_samples: int = 0
    """Held-out prompts an evaluation generates, one response each (lengths as ``lengths``),
    spread over the engines; the driver, and so the trainer, waits for all of them, while
    fully-async's admitted rollout keeps generating beside them."""
    eval_in_wall: bool = True
    """False: the evaluations' time is taken out of the wall clock, as ``bench.async_vs_sync``
    did before ``eval_in_window`` (the rollout's generation during them stays counted)."""

    def decode_s(self, batch: int) -> float:
        """One decode step of one engine running ``batch`` sequences."""
        return self.decode_base_s + self.decode_per_seq_s * batch

    def train_s(self, tokens: float) -> float:
        """One trainer step on ``tokens`` (prompt + response) tokens."""
        rate = self.num_trainer * (self.dp_efficiency if self.num_trainer > 1 else 1.0)
        return self.train_fixed_s + self.train_per_token_s * tokens / rate


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A policy as ``policies.config.PolicyConfig`` spells it, plus the in-flight mode."""

    type: Literal["sync", "one_step_off", "fully_async"]
    staleness_threshold: float = 1.0
    max_staleness: int = 2
    sync_every: int = 1
    in_flight: Literal["abort", "keep", "recompute"] = "abort"
    overlap_push: bool = False
    eval_overlap_steps: int | None = None
    """``None``: the trainer waits for every evaluation (what the code before evaluations ran
    beside training did). An int: ``policy.eval_overlap_steps``, evaluations run beside
    training: the push due after one waits for it; fully-async trains on for up to
    ``min(eval_overlap_steps, max_staleness - 1)`` steps meanwhile, each opening its admission
    window without a push (the sync baselines: the next batch generates beside it)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """Rates over the timed steps; the rest describe the whole run."""

    steps_per_s: float
    trained_tokens_per_s: float
    samples_per_s: float
    max_ahead_samples: int
    """Most samples ever admitted and not yet trained (the staleness bound's effect)."""
    max_version_lag: int
    """Largest (trainer version - sample's admission version) among trained samples."""
    dropped: int
    reprefill_tokens: float
    trainer_idle_ratio: float
    decode_steps_per_step: float = 0.0
    """Decode steps of the engines, summed, per trainer step (a check against engine counters)."""
    eval_s_per_step: float = 0.0
    """Time the driver spent in evaluations, per trainer step."""


@dataclasses.dataclass
class _Seq:
    length: int
    prompt_len: int
    group: int
    version: int
    uid: int  # the order of admission: breaks ties between equal finish times reproducibly
    left: float = 0.0  # tokens still to generate (kept up to date while not running)
    finish_at: float = 0.0  # the engine clock at which it finishes, while running
    prefilled: bool = False
    eval: bool = False  # an evaluation's response: never trained

    def __post_init__(self) -> None:
        self.left = float(self.length)


class _Engine:
    """One rollout engine. ``clock`` counts the decode steps every running sequence has taken;
    a running sequence finishes when the clock reaches its ``finish_at`` (a heap keeps the next)."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.running: dict[int, _Seq] = {}
        self.finish: list[tuple[float, int]] = []  # (finish_at, id) of running sequences
        self.waiting: deque[_Seq] = deque()
        self.busy_until = 0.0  # prefill or pause: no decode progress before this
        self.paused = False
        self.last_t = 0.0
        self.clock = 0.0

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def step_s(self) -> float:
        f = self.sim.inp.interference
        s = max(f.decode_floor_s, self.sim.inp.decode_s(len(self.running)))
        return s * (f.engine_shared if self.sim.trainer_busy else f.engine_alone)

    def advance(self, t: float) -> None:
        start = max(self.last_t, self.busy_until)
        if not self.paused and self.running and t > start:
            self.clock += (t - start) / self.step_s()
        self.last_t = max(self.last_t, t)

    def next_t(self) -> float:
        if self.paused:
            return INF
        if self.waiting and len(self.running) < self.sim.inp.max_running:
            return max(self.last_t, self.busy_until)
        if not self.running:
            return INF
        return max(self.last_t, self.busy_until) + max(0.0, self.finish[0][0] - self.clock) * self.step_s()

    def take_running(self) -> list[_Seq]:
        """Remove every running sequence (their ``left`` brought up to date)."""
        seqs = list(self.running.values())
        for s in seqs:
            s.left = s.finish_at - self.clock
        self.running.clear()
        self.finish.clear()
        return seqs

    def generated(self) -> float:
        """Tokens the running sequences hold (what a re-prefill recomputes, prompts aside)."""
        return sum(s.length - (s.finish_at - self.clock) for s in self.running.values())

    def on_event(self, t: float) -> None:
        done: list[_Seq] = []
        while self.finish and self.finish[0][0] - self.clock <= 1e-9:
            _, sid = heapq.heappop(self.finish)
            s = self.running.pop(sid)
            s.left = 0.0
            done.append(s)
        if done and self.sim.inp.sample_overhead_s:
            # the engine handles the results before it steps on; they are delivered once handled
            self.busy_until = max(t, self.busy_until) + len(done) * self.sim.inp.sample_overhead_s
            self.sim.deliver_at(self.busy_until, done)
        else:
            for s in done:
                self.sim.finished(s, t)
        prefill_tokens = 0.0
        num_admitted = 0
        while self.waiting and len(self.running) < self.sim.inp.max_running:
            s = self.waiting.popleft()
            num_admitted += 1
            prefill_tokens += s.prompt_len + (s.length - s.left)
            if s.prefilled:
                self.sim.reprefill_tokens += s.prompt_len + (s.length - s.left)
            elif not s.eval:  # its first token's version, which the trainer's age bound reads
                s.version = self.sim.version
            s.prefilled = True
            s.finish_at = self.clock + s.left
            self.running[s.uid] = s
            heapq.heappush(self.finish, (s.finish_at, s.uid))
        if prefill_tokens:
            self.busy_until = max(t, self.busy_until) + prefill_tokens * self.sim.inp.prefill_per_token_s
            if self.sim.inp.prefill_per_seq_s:
                self.busy_until += num_admitted * self.sim.inp.prefill_per_seq_s


class _Sim:
    """One run of a schedule: the event loop, the admission counter, the trainer and the pushes."""

    def __init__(self, inp: Inputs, sched: Schedule, num_steps: int, seed: int) -> None:
        if inp.samples_per_step % inp.group_size:
            raise ValueError(f"samples_per_step {inp.samples_per_step} is not a multiple of "
                             f"group_size {inp.group_size}")
        if sched.eval_overlap_steps is not None and not inp.eval_in_wall:
            raise ValueError("evaluations beside training (eval_overlap_steps) are timed in the wall "
                             "clock: eval_in_wall must be true")
        if sched.sync_every < 1 or sched.staleness_threshold < 0 or sched.max_staleness < 0:
            raise ValueError(f"bad schedule {sched}")
        self.inp, self.sched, self.num_steps = inp, sched, num_steps
        self.rng = random.Random(seed)
        self.engines = [_Engine(self) for _ in range(inp.num_rollout)]
        self.events: list[tuple[float, int, str]] = []
        self._tie = 0
        self.deliveries: dict[int, list[_Seq]] = {}  # "deliver" event -> the sequences it delivers
        self.t = 0.0
        self.version = 0
        self.steps = 0
        self.trained_tokens = self.trained_samples = 0
        self.trainer_busy = False
        self.trainer_blocked = False  # waiting for a push (all of it, or its encode with overlap)
        self.trainer_busy_s = 0.0
        self.groups_left: dict[int, int] = {}
        self.group_seqs: dict[int, list[_Seq]] = {}
        self.group_batch: dict[int, int] = {}
        self.batch_left: dict[int, int] = {}
        self.queue: deque[int] = deque()  # finished groups, oldest first
        self.num_queued = 0  # samples in those groups
        self.num_groups = 0
        # admitted samples whose group is not finished (policies.fully_async's in_flight: a group
        # is one request, reported whole), and those the trainer holds (leased until its step acks)
        self.in_flight = 0
        self.training = 0
        self.reprefill_tokens = 0.0
        self.dropped = 0
        self.max_ahead = 0
        self.max_lag = 0
        self.eval_s = 0.0  # time the driver spent in evaluations
        self.eval_rng = random.Random(f"eval{seed}")  # the training samples' lengths do not depend on evals
        self.eval_due = False  # the step just trained ends with an evaluation
        self.eval_left = self.num_eval_seqs = 0
        self.eval_t0 = 0.0
        self.evaluating = False  # an evaluation beside training is running (Schedule.eval_overlap_steps)
        self.owed = 0  # fully-async steps trained beside it whose push waits for it
        self.push_after_eval = False  # the trainer waits at a push until the evaluation ends
        # after each step: (timed clock, trained tokens, trained samples, decode steps of all engines,
        # evaluation seconds)
        self.history: list[tuple[float, int, int, float, float]] = []
        # fully-async admission: policies.admission's window
        self.budget = math.ceil((1.0 + sched.staleness_threshold) * sched.sync_every * inp.samples_per_step - 1e-9)
        self.carried = self.admitted_in_window = 0
        self.pushing = self.push_pending = False
        # sync / one-step-off: batch k's groups are generated together
        self.gen_started = self.gen_done = 0

    # -- plumbing ---------------------------------------------------------------
    def at(self, t: float, kind: str) -> None:
        self._tie += 1
        heapq.heappush(self.events, (t, self._tie, kind))

    def deliver_at(self, t: float, seqs: list[_Seq]) -> None:
        """Finished sequences reach the driver at ``t`` (after their engine handled them)."""
        self.at(t, "deliver")
        self.deliveries[self._tie] = seqs

    def timed(self) -> float:
        """The clock as the bench times it (evaluations taken out when not in the wall)."""
        return self.t if self.inp.eval_in_wall else self.t - self.eval_s

    def decode_steps(self) -> float:
        return sum(e.clock for e in self.engines)

    def rollout_busy(self) -> bool:
        return any(e.running or e.waiting for e in self.engines)

    def sync_engines(self) -> None:
        for e in self.engines:
            e.advance(self.t)

    def admit_group(self, batch: int) -> None:
        g = self.num_groups
        self.num_groups += 1
        seqs = [_Seq(self.inp.lengths.sample(self.rng), self.inp.prompt_len, g, self.version,
                     g * self.inp.group_size + i) for i in range(self.inp.group_size)]
        self.groups_left[g], self.group_seqs[g], self.group_batch[g] = len(seqs), seqs, batch
        self.batch_left[batch] = self.batch_left.get(batch, 0) + 1
        self.in_flight += len(seqs)
        # A group is one request to one rollout actor (generate_group): its samples share an engine.
        min(self.engines, key=_Engine.load).waiting.extend(seqs)
        self.max_ahead = max(self.max_ahead, self.in_flight + self.queued_samples() + self.training)

    def finished(self, s: _Seq, t: float) -> None:
        if s.eval:
            self.eval_left -= 1
            if not self.eval_left:
                self.at(t, "eval_done")
            return
        self.groups_left[s.group] -= 1
        if self.groups_left[s.group] == 0:
            self.in_flight -= len(self.group_seqs[s.group])
            self.queue.append(s.group)
            self.num_queued += len(self.group_seqs[s.group])
            b = self.group_batch[s.group]
            self.batch_left[b] -= 1
            while self.batch_left.get(self.gen_done) == 0 and self.gen_done < self.gen_started:
                self.gen_done += 1

    def queued_samples(self) -> int:
        return self.num_queued

    # -- schedule logic ----------------------------------------------------------
    def start_generation(self) -> None:
        b = self.gen_started
        self.gen_started += 1
        for _ in range(self.inp.samples_per_step // self.inp.group_size):
            self.admit_group(b)

    def feed(self) -> None:
        """Fully-async feeder: admit groups while the window allows (policies.admission)."""
        n = self.inp.group_size
        while self.carried + self.admitted_in_window + n <= self.budget:
            self.admitted_in_window += n
            self.admit_group(-1)

    def drop_stale(self) -> None:
        """The trainer-side age bound: a group whose oldest sample is more than ``max_staleness``
        versions old is dropped, and its admission slots go back."""
        keep: deque[int] = deque()
        for g in self.queue:
            if self.version + self.owed - min(s.version for s in self.group_seqs[g]) <= self.sched.max_staleness:
                keep.append(g)
                continue
            n = len(self.group_seqs.pop(g))
            self.dropped += n
            self.num_queued -= n
            take = min(n, self.carried)
            self.carried -= take
            self.admitted_in_window = max(0, self.admitted_in_window - (n - take))
        self.queue = keep

    def try_train(self) -> None:
        if self.trainer_busy or self.trainer_blocked or self.steps >= self.num_steps:
            return
        typ = self.sched.type
        if typ == "fully_async":
            self.drop_stale()
            self.feed()
            if self.queued_samples() < self.inp.samples_per_step:
                return
        elif self.gen_done <= self.steps or self.pushing:
            return
        batch: list[_Seq] = []
        while len(batch) < self.inp.samples_per_step:
            batch.extend(self.group_seqs.pop(self.queue.popleft()))
        self.num_queued -= len(batch)
        tokens = sum(s.length + s.prompt_len for s in batch)
        self.trained_tokens += sum(s.length for s in batch)
        self.trained_samples += len(batch)
        self.max_lag = max(self.max_lag, max(self.version + self.owed - s.version for s in batch))
        if typ == "one_step_off" and self.gen_started < self.num_steps:
            self.start_generation()  # batch k+1 generates while batch k trains
        self.sync_engines()
        f = self.inp.interference
        dur = self.inp.train_s(tokens) * (f.trainer_shared if self.rollout_busy() else f.trainer_alone)
        dur += self.inp.step_overhead_s
        self.trainer_busy = True
        self.training = len(batch)
        self.trainer_busy_s += dur
        self.at(self.t + dur, "train_done")

    def on_train_done(self) -> None:
        self.trainer_busy = False
        self.training = 0
        self.steps += 1
        self.history.append((self.timed(), self.trained_tokens, self.trained_samples, self.decode_steps(),
                             self.eval_s))
        self.eval_due = (self.inp.eval_every > 0 and self.steps % self.inp.eval_every == 0
                         and self.steps < self.num_steps)
        if self.beside():
            self.after_step_beside()
        elif self.steps % self.sched.sync_every:
            if not self.eval_due:
                self.try_train()
            elif self.pushing:
                self.trainer_blocked = True  # the evaluation waits for the push still applying
            else:
                self.start_eval()
        elif self.pushing:
            self.push_pending = True  # an overlapped push is still being applied
            self.trainer_blocked = True
        else:
            self.begin_push()

    def beside(self) -> bool:
        return self.sched.eval_overlap_steps is not None

    def overlap_steps(self) -> int:
        """Fully-async steps beside an evaluation without their push (policies.fully_async)."""
        return min(self.sched.eval_overlap_steps or 0, max(0, self.sched.max_staleness - 1))

    def after_step_beside(self) -> None:
        """``policies``' after-step with evaluations beside training: a push due waits for a
        running evaluation (fully-async first trains on, without it, ``overlap_steps`` steps);
        an evaluation due starts once its step's push is done, and the trainer goes on."""
        if self.evaluating and self.eval_due:
            # one evaluation at a time: the driver waits for the last one before it starts one
            self.trainer_blocked = self.push_after_eval = True
            return
        if self.steps % self.sched.sync_every == 0 or self.owed:
            if not self.evaluating:
                if self.pushing:
                    self.push_pending = True  # an overlapped push is still being applied
                    self.trainer_blocked = True
                else:
                    self.begin_push()
                return
            if self.sched.type == "fully_async" and self.owed < self.overlap_steps():
                self.owed += 1
                self.open_window()  # filled by try_train's feed below
            else:
                self.trainer_blocked = self.push_after_eval = True
                return
        if self.eval_due and not self.pushing:
            self.start_eval()
        self.try_train()

    def open_window(self) -> None:
        """policies.admission's window opens: whatever is outstanding is carried into it."""
        self.carried, self.admitted_in_window = self.in_flight + self.queued_samples() + self.training, 0

    def begin_push(self) -> None:
        self.pushing, self.push_pending = True, False
        self.trainer_blocked = True
        if self.sched.type == "fully_async" and self.sched.overlap_push:
            self.at(self.t + self.inp.push_encode_s, "trainer_free")
        if self.sched.type == "one_step_off" and self.gen_done < self.gen_started:
            return  # the push waits until batch k+1 has finished generating (on_groups_changed)
        # Engines generate through the encode; they pause for transfer + apply.
        self.at(self.t + max(0.0, self.inp.push_s - self.inp.push_paused_s), "pause")

    def on_pause(self) -> None:
        for e in self.engines:
            e.paused = True
        self.at(self.t + self.inp.push_paused_s, "push_done")

    def on_push_done(self) -> None:
        self.version += 1 + self.owed
        self.owed = 0
        mode = self.sched.in_flight if self.sched.type == "fully_async" else "keep"
        for e in self.engines:
            e.paused = False
            e.last_t = self.t
            if mode == "abort" and e.running:
                # The partial stays with its rollout actor (its engine) and is resubmitted behind the
                # requests already waiting there; its prompt + partial are prefilled again.
                e.waiting.extend(e.take_running())
                if self.inp.resume_overhead_s:
                    e.busy_until = max(e.busy_until, self.t + self.inp.resume_overhead_s)
            elif mode == "recompute" and e.running:
                toks = len(e.running) * self.inp.prompt_len + e.generated()
                self.reprefill_tokens += toks
                e.busy_until = (max(e.busy_until, self.t) + toks * self.inp.prefill_per_token_s
                                + len(e.running) * self.inp.prefill_per_seq_s)
        self.pushing = False
        if self.sched.type == "fully_async":
            self.open_window()
        if self.push_pending:
            self.begin_push()
            return
        if self.eval_due and self.beside():
            self.start_eval()  # beside training: the trainer goes on below
        elif self.eval_due:
            if self.sched.type == "fully_async":
                self.feed()  # the feeder is not the driver: the window that opened is filled now
            self.start_eval()
            return
        self.resume_trainer()

    def resume_trainer(self) -> None:
        """Nothing holds the trainer now: sync's next batch starts generating, a step may start."""
        self.trainer_blocked = False
        if self.sched.type == "sync" and self.gen_started < self.num_steps:
            self.start_generation()
        self.try_train()

    def start_eval(self) -> None:
        """The driver evaluates (``policies.base``'s ``evaluate``): one response per held-out
        prompt, spread over the engines behind what waits there; the trainer waits for all,
        or (``eval_overlap_steps``) goes on beside them."""
        self.eval_due = False
        if self.beside():
            self.evaluating = True
        else:
            self.trainer_blocked = True
        self.eval_t0 = self.t
        self.eval_left = self.inp.eval_samples
        for i in range(self.inp.eval_samples):
            self.num_eval_seqs += 1
            s = _Seq(self.inp.lengths.sample(self.eval_rng), self.inp.prompt_len, -1, self.version,
                     -self.num_eval_seqs, eval=True)
            self.engines[i % len(self.engines)].waiting.append(s)
        if not self.eval_left:
            self.at(self.t, "eval_done")

    def on_eval_done(self) -> None:
        self.eval_s += self.t - self.eval_t0
        if self.beside():
            self.evaluating = False
            if self.push_after_eval:  # the push (or the evaluation) the trainer waits at goes now
                self.push_after_eval = self.trainer_blocked = False
                self.after_step_beside()
            return
        self.resume_trainer()

    def on_groups_changed(self) -> None:
        if self.pushing and self.sched.type == "one_step_off" and self.gen_done >= self.gen_started:
            # the whole push follows the generation (policies.baselines: no sync while one is in
            # flight): its encode, then the engines' pause
            self.at(self.t + max(0.0, self.inp.push_s - self.inp.push_paused_s), "pause")
        self.try_train()

    # -- main loop ---------------------------------------------------------------
    def run(self) -> Result:
        if self.sched.type == "fully_async":
            self.feed()
        else:
            self.start_generation()
        while self.steps < self.num_steps:
            te = self.events[0][0] if self.events else INF
            eng = min(self.engines, key=_Engine.next_t)
            tn = eng.next_t()
            if te == INF and tn == INF:
                raise RuntimeError(f"deadlock at step {self.steps} ({self.sched.type})")
            if te <= tn:
                self.t, tie, kind = heapq.heappop(self.events)
                self.sync_engines()
                if kind == "deliver":
                    before = len(self.queue)
                    for s in self.deliveries.pop(tie):
                        self.finished(s, self.t)
                    if len(self.queue) != before:
                        self.on_groups_changed()
                elif kind == "train_done":
                    self.on_train_done()
                elif kind == "pause":
                    self.on_pause()
                elif kind == "push_done":
                    self.on_push_done()
                elif kind == "eval_done":
                    self.on_eval_done()
                else:  # trainer_free: an overlapped push's encode is done
                    if not self.push_pending and not self.push_after_eval and (not self.eval_due or self.beside()):
                        self.trainer_blocked = False
                    self.try_train()
            else:
                self.t = tn
                self.sync_engines()
                before = len(self.queue)
                eng.on_event(self.t)
                if len(self.queue) != before:
                    self.on_groups_changed()
        wall = self.timed()
        return Result(steps_per_s=self.steps / wall, trained_tokens_per_s=self.trained_tokens / wall,
                      samples_per_s=self.trained_samples / wall, max_ahead_samples=self.max_ahead,
                      max_version_lag=self.max_lag, dropped=self.dropped, reprefill_tokens=self.reprefill_tokens,
                      trainer_idle_ratio=max(0.0, 1.0 - self.trainer_busy_s / wall),
                      decode_steps_per_step=self.history[-1][3] / self.steps,
                      eval_s_per_step=self.history[-1][4] / self.steps)


def simulate(inp: Inputs, sched: Schedule, num_steps: int = 40, seed: int = 0, warmup_steps: int = 0) -> Result:
    """Run ``warmup_steps + num_steps`` trainer steps; rates are over the last ``num_steps``
    (from the end of the last warm-up step, as ``bench.async_vs_sync`` times them)."""
    sim = _Sim(inp, sched, warmup_steps + num_steps, seed)
    r = sim.run()
    if not warmup_steps:
        return r
    t0, tok0, smp0, dec0, eval0 = sim.history[warmup_steps - 1]
    span = sim.timed() - t0
    return dataclasses.replace(r, steps_per_s=num_steps / span, trained_tokens_per_s=(sim.trained_tokens - tok0) / span,
                               samples_per_s=(sim.trained_samples - smp0) / span,
                               decode_steps_per_step=(sim.history[-1][3] - dec0) / num_steps,
                               eval_s_per_step=(sim.history[-1][4] - eval0) / num_steps)
