"""Reward functions on decoded text: plain functions ``(text, answer) -> float``
in [0, 1], where ``text`` is the model's response (special tokens removed) and
``answer`` the row's ground truth.

    exact_match   the whole response equals the answer, after stripping
                  whitespace and trailing punctuation (``.,;:!?``); case-sensitive
    math          the response's final answer equals the ground truth as a number
                  (see :func:`math_answer`); 1.0 or 0.0
    pkg.mod:fn    a user function, imported by path when the task is built, run
                  with a timeout on its own thread (see :func:`resolve_reward`)

The rollout actor calls a task's reward on its worker thread under
``policy.reward_timeout_s`` and counts a failure (raise, hang, a value outside
[0, 1]) as a dropped sample. A user function additionally runs on a thread of
its own under the same timeout, so one that hangs costs the actor one timed-out
sample instead of its worker thread (which weight updates also run on).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import queue
import re
import threading
from collections.abc import Callable
from fractions import Fraction

__all__ = ["BUILTIN_REWARDS", "exact_match", "extract_final_answer", "math_answer", "parse_number", "resolve_reward"]

RewardFn = Callable[[str, str], float]

_TRAILING_PUNCT = ".,;:!?"


def exact_match(text: str, answer: str) -> float:
    """1.0 when ``text`` equals ``answer`` once both lose surrounding whitespace
    and trailing punctuation (``"Paris."`` matches ``"Paris"``); case-sensitive."""
    return float(_strip_exact(text) == _strip_exact(answer))


def _strip_exact(s: str) -> str:
    return s.strip().rstrip(_TRAILING_PUNCT).strip()


# A number in running text: an optional sign (not a hyphen between two words or
# digits), thousands groups or plain digits, an optional decimal part, an
# optional "/denominator". Linear: no nested quantifiers.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?")
_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRACTION = re.compile(r"([-+]?)\(?([-+]?[\d.]+)\)?/\(?([-+]?[\d.]+)\)?")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{[^{}]*\}")


def parse_number(s: str) -> Fraction | None:
    """The exact value of a number written as ``42``, ``+42``, ``-3.50``, ``1,234``,
    ``3/4``, ``\\frac{3}{4}``, ``1e3``, ``50%`` (read as 50), maybe in ``$...$``
    or followed by a ``\\text{unit}``; None when ``s`` is not one number."""
    s = s.strip().replace("\u2212", "-")  # unicode minus
    s = _LATEX_TEXT.sub("", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace("\\$", "").replace("\\%", "%")
    s = s.strip().strip("$").strip().rstrip(".").rstrip("%").replace(" ", "")
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        m = _FRACTION.fullmatch(s)
        if m:
            den = Fraction(m.group(3))
            if den == 0:
                return None
            value = Fraction(m.group(2)) / den
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced) or
    ``\\boxed x``; None when there is none, or the last one is unclosed."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # "\boxed 5": up to the next space or "$"
        return re.split(r"[\s$]", text[i:], maxsplit=1)[0] or None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution: the last ``\\boxed{...}``, else
    what follows the last ``####`` on its line, else the last number in the
    text; None when there is none of these."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marker = text.rfind("####")
    if marker >= 0:
        after = text[marker + 4:].strip().split("\n", 1)[0].strip()
        if after:
            return after
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _value(answer: str) -> Fraction | None:
    """A number for an extracted answer: the whole of it, else its last number
    (``x = 5`` -> 5, ``72 dollars`` -> 72)."""
    value = parse_number(answer)
    if value is None:
        numbers = _NUMBER.findall(answer)
        value = parse_number(numbers[-1]) if numbers else None
    return value


def math_answer(text: str, answer: str) -> float:
    """1.0 when the final answer of ``text`` (see :func:`extract_final_answer`)
    equals ``answer`` as a number, exactly (``0.5`` = ``1/2`` = ``\\frac{1}{2}``,
    ``1,234`` = ``1234``, ``+7`` = ``7.0``, ``50%`` = ``50``), else 0.0.

    ``answer`` may be a bare number or a worked solution itself (a GSM8K
    ``... #### 72`` or a MATH ``... \\boxed{72}``): its final answer is taken
    the same way. When either side is not a number, the two are compared as
    strings with spaces and ``$`` removed (``\\boxed{B}`` matches ``B``)."""
    pred = extract_final_answer(text)
    if pred is None:
        return 0.0
    gold = answer.strip()
    gold_value = parse_number(gold)
    if gold_value is None:
        gold = extract_final_answer(gold) or gold
        gold_value = _value(gold)
    pred_value = _value(pred)
    if gold_value is not None and pred_value is not None:
        return float(pred_value == gold_value)
    norm = lambda s: s.replace(" ", "").strip("$")  # noqa: E731
    return float(norm(pred) == norm(gold))


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_answer}


def resolve_reward(spec: str, *, timeout_s: float) -> RewardFn:
    """The reward function named by ``spec``: a built-in name (``exact_match``,
    ``math``) or ``package.module:function`` (``function`` may be dotted, e.g.
    ``Class.method``), imported now. A user function is wrapped to run on its
    own thread under ``timeout_s`` (see :class:`TimedReward`).

    Raises ``ValueError`` naming ``spec`` when it is neither, when its module
    cannot be imported, or when what it names is missing or not callable."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected one of {', '.join(BUILTIN_REWARDS)} "
                         "or an import path 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any failure while importing user code is a bad reward path
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return TimedReward(obj, name=spec, timeout_s=timeout_s)


class TimedReward:
    """Runs a user reward function on a daemon thread of its own and waits at
    most ``timeout_s`` for it; a call that takes longer raises ``TimeoutError``
    and its thread is abandoned (it exits when the call ends), the next call
    gets a fresh one. So a hung function never holds its caller's thread, and
    threads are made only on timeouts. With ``max_stuck`` abandoned calls
    still running, further calls fail at once (``RuntimeError``) rather than
    pile up threads. A result that is not a finite number in [0, 1] raises
    ``ValueError`` naming the function."""

    def __init__(self, fn: RewardFn, *, name: str, timeout_s: float, max_stuck: int = 4) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward {name!r}: timeout_s must be > 0, got {timeout_s}")
        self.fn, self.name, self.timeout_s, self.max_stuck = fn, name, timeout_s, max_stuck
        self.num_timeouts = 0
        self._num_stuck = 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue | None = None

    def __call__(self, text: str, answer: str) -> float:
        with self._lock:
            if self._num_stuck >= self.max_stuck:
                raise RuntimeError(f"reward {self.name!r}: {self._num_stuck} calls still running after timing "
                                   f"out ({self.timeout_s} s); refusing more until they end")
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(self._jobs,), name="reward-fn", daemon=True).start()
            jobs = self._jobs
        done: concurrent.futures.Future = concurrent.futures.Future()
        jobs.put((done, text, answer))
        try:
            value = done.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            done.cancel()  # still queued behind a hung call: never run it
            with self._lock:
                self.num_timeouts += 1
                if self._jobs is jobs:  # abandon this thread: it exits when the hung call ends
                    self._jobs = None
                    self._num_stuck += 1
                    jobs.put(None)
            raise TimeoutError(f"reward {self.name!r} took longer than {self.timeout_s} s") from None
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"reward {self.name!r} returned {value!r}; expected a number in [0, 1]")
        return float(value)

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                break
            done, text, answer = job
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(self.fn(text, answer))
            except Exception as e:  # delivered to the caller, who counts it
                done.set_exception(e)
            except BaseException as e:  # SystemExit and the like must not end the caller
                done.set_exception(RuntimeError(f"reward {self.name!r} raised {type(e).__name__}: {e}"))
        with self._lock:
            if self._jobs is not jobs:
                self._num_stuck -= 1
