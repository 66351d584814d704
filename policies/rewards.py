"""Reward functions on decoded text, and the user functions a run may name.

Every reward is adapted, when it is resolved, to one internal call
``reward(response: Response) -> float``, where the :class:`Response`
holds the model's decoded text (special tokens removed), the row's ground
truth and the row itself. A user function may be written in any of three forms,
told apart by its parameter names (read once, when the config loads). Any
finite number is a score (GRPO compares the scores of one prompt's group, so
their scale is the user's); NaN, an infinity or what is no number raise
:class:`RewardValueError`, which names the function's file and line:

    text   fn(text, answer) -> float                        this repo's own form
    verl   compute_score(data_source, solution_str, ground_truth, extra_info=None)
                            -> float, or a dict with a "score"
    trl    reward_func(completions, **kwargs) -> list[float | None]
           called per sample with lists of one: ``prompts``, ``completions``
           (text, or ``[{"role": "assistant", "content": text}]`` when the
           prompt is chat messages), ``completion_ids``, and each other column
           of the row; ``None`` ("not applicable") scores 0.0, which is what
           TRL's sum over reward functions makes of it when it is the only one

A TRL function reads no answer: a dataset needs an answer field only for the
other two forms (and the built-in rewards, which are in the first).

Names a run may give (``task.kwargs.reward``; from Python, ``launch(reward=fn)``
passes the function itself):

    exact_match   the whole response equals the answer, after stripping
                  whitespace and trailing punctuation (``.,;:!?``); case-sensitive
    math          the response's final answer equals the ground truth as a number
                  (see :func:`math_answer`); 1.0 or 0.0
    pkg.mod:fn    a user function, imported by path when the task is built, run
                  with a timeout on its own thread (see :func:`resolve_reward`)
    file.py:fn    the same, from a Python file (verl's custom_reward_function.path)

The rollout actor calls a task's reward on its reward pool, ``policy.reward_workers``
calls at once, under ``policy.reward_timeout_s`` and counts a failure (raise, hang,
a value that is no finite number) as a dropped sample. A user function additionally
runs on a thread of its own under the same timeout, so one that hangs costs the actor
one timed-out sample instead of a worker of its pool. A function in any form may be
``async def``: its coroutine is awaited on the process's one loop, beside the
others in flight (it must not block that loop: ``await`` the slow parts).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import pathlib
import re
import sys
import types
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import msgspec

from policies.reward_calls import TimedReward, settle

__all__ = ["BUILTIN_REWARDS", "FORMS", "Response", "RewardValueError", "anchor_reward_spec", "defined_at",
           "exact_match", "extract_final_answer", "math_answer", "parse_number", "resolve_reward", "reward_form",
           "reward_name"]

RewardFn = Callable[[str, str], float]


class Response(msgspec.Struct, frozen=True, kw_only=True):
    """One response to score and the row it answers: all that a reward in any
    of its forms is given."""

    text: str
    """The response, cut at its first stop token, special tokens skipped."""
    answer: str
    """The row's ground truth, as text."""
    prompt: str | list[dict[str, object]] = ""
    """The row's prompt as written: text, or chat messages ("" for generated tasks)."""
    ids: list[int] = msgspec.field(default_factory=list)
    """The response's token ids as generated (TRL's ``completion_ids``)."""
    fields: dict[str, object] = msgspec.field(default_factory=dict)
    """The whole row, every column (verl's ``data_source``, ``extra_info``; TRL's keyword lists)."""

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

#: The forms a user reward function may take, by the parameter names that tell them apart.
FORMS = {"text": "(text, answer)", "verl": "(data_source, solution_str, ground_truth, extra_info=None)",
         "trl": "(completions, **kwargs)"}


class RewardValueError(ValueError):
    """A user reward function returned what is no score (NaN, an infinity, not a
    number, a TRL list of the wrong length). ``location`` is where the function
    is defined (``file:line``, "" when unknown): what the run's error line names,
    since the traceback ends in this module, not the user's."""

    def __init__(self, message: str, location: str = "") -> None:
        super().__init__(message)
        self.location = location

    def __reduce__(self) -> tuple[type[RewardValueError], tuple[str, str]]:  # keeps ``location`` across processes
        return type(self), (str(self), self.location)


def resolve_reward(spec: str | Callable[..., object], *, timeout_s: float) -> Callable[[Response], float]:
    """The reward named by ``spec`` as one call ``reward(response) -> float``: a
    built-in name (``exact_match``, ``math``), ``package.module:function``
    (``function`` may be dotted, e.g. ``Class.method``) or ``path/to/file.py:function``,
    imported now, or the function itself (``launch(reward=fn)``), in whichever of
    :data:`FORMS` its signature shows. A user function runs on its own thread under
    ``timeout_s`` (see :class:`TimedReward`).

    Raises ``ValueError`` naming ``spec`` when it is none of these, when its module
    cannot be imported, when what it names is missing or not callable, or when
    its signature fits no form."""
    if isinstance(spec, str) and spec in BUILTIN_REWARDS:
        return _adapt(BUILTIN_REWARDS[spec], "text")
    fn, name = _function(spec)
    return TimedReward(_adapt(fn, _form(fn, name), name), name=name, timeout_s=timeout_s)


def reward_form(spec: str | Callable[..., object]) -> str:
    """The form (a key of :data:`FORMS`) of the reward ``spec`` names (or is), importing
    it; ``ValueError`` as :func:`resolve_reward` raises. What the config checks on load."""
    if isinstance(spec, str) and spec in BUILTIN_REWARDS:
        return "text"
    fn, name = _function(spec)
    return _form(fn, name)


def reward_name(fn: Callable[..., object]) -> str:
    """``module:qualname`` of a function (what errors and the run's config call it)."""
    fn = inspect.unwrap(fn)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}:{qualname}"


def defined_at(fn: Callable[..., object]) -> str:
    """``file:line`` where ``fn`` (a function, a method, a partial of one or an object
    with ``__call__``) is defined; "" when it has no Python source (a builtin)."""
    fn = inspect.unwrap(fn)
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _function(spec: str | Callable[..., object]) -> tuple[Callable[..., object], str]:
    """The user function ``spec`` names (imported) or is, and its name for errors."""
    if isinstance(spec, str):
        return _import(spec), spec
    if not callable(spec):
        raise ValueError(f"reward: expected a function or a name, got {type(spec).__name__} {spec!r:.80}")
    return spec, reward_name(spec)


def anchor_reward_spec(spec: str, base_dir: str) -> str:
    """``spec`` with a relative ``file.py`` made absolute: against ``base_dir`` (the
    config file's directory) when the file is there, else the current directory,
    as data files are. Other specs are returned unchanged."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path.endswith(".py") or pathlib.Path(path).expanduser().is_absolute():
        return spec
    near = pathlib.Path(base_dir) / path
    return f"{(near if near.is_file() else pathlib.Path.cwd() / path).resolve()}:{attr}"


def _import(spec: str) -> Callable[..., object]:
    path, sep, attr = spec.rpartition(":")  # rpartition: a file path may hold a ':' (C:\...)
    if sep and path.endswith(".py") and attr:
        obj = _import_file(spec, pathlib.Path(path).expanduser())
        where = f"file {path!r}"
    else:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"reward {spec!r}: expected one of {', '.join(BUILTIN_REWARDS)}, an import path "
                             "'package.module:function' or a file 'path/to/file.py:function'")
        try:
            obj = importlib.import_module(module_name)
        except Exception as e:  # any failure while importing user code is a bad reward path
            raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: "
                             f"{type(e).__name__}: {e}") from None
        where = f"module {module_name!r}"
    if "<" in attr:  # "f.<locals>.g", "<lambda>": what launch(reward=fn) recorded of a function it was given
        raise ValueError(f"reward {spec!r}: a function defined inside another (or a lambda) has no import path; "
                         "pass the function itself again: launch(..., reward=fn)")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _import_file(spec: str, path: pathlib.Path) -> types.ModuleType:
    """The module of the Python file ``path``, executed once per process: its
    name is derived from the absolute path, so a task built twice reuses it."""
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: no such file {str(path)!r} (looked for {path.absolute()})")
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    name = f"_asyncrl_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec_ = importlib.util.spec_from_file_location(name, path)
    assert spec_ is not None and spec_.loader is not None, path  # a .py file's: a source loader
    module = importlib.util.module_from_spec(spec_)
    sys.modules[name] = module  # before running it: dataclasses and pickle look modules up by name
    try:
        spec_.loader.exec_module(module)
    except Exception as e:  # any failure while running user code is a bad reward file
        del sys.modules[name]
        raise ValueError(f"reward {spec!r}: cannot import {str(path)!r}: {type(e).__name__}: {e}") from None
    return module


def _form(fn: Callable[..., object], name: str) -> str:
    """Which of :data:`FORMS` ``fn`` is written in, by its parameter names: verl's
    when it names ``solution_str`` and ``ground_truth``, TRL's when it names
    ``completions``, else this repo's when it takes two positional arguments.
    ``ValueError`` naming ``fn`` and the forms when it cannot be called as any."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: no names to read; today's form, as before
        return "text"
    if {"solution_str", "ground_truth"} <= sig.parameters.keys():
        form, probe = "verl", lambda: sig.bind(**dict.fromkeys(_verl_keywords(sig)))
    elif "completions" in sig.parameters:  # other parameters may be dataset columns: only this one is known now
        form, probe = "trl", lambda: sig.bind_partial(completions=[])
    else:
        form, probe = "text", lambda: sig.bind("", "")
    try:
        probe()
    except TypeError:
        forms = "; ".join(f"{k} {v}" for k, v in FORMS.items())
        raise ValueError(f"reward {name!r}: its signature {sig} fits none of the accepted forms: {forms}") from None
    return form


def _takes_any_keyword(sig: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def _verl_keywords(sig: inspect.Signature) -> tuple[str, ...]:
    """What verl passes (all by keyword) that the function takes, so one written
    without ``extra_info`` (verl's optional argument) works too."""
    names = ("data_source", "solution_str", "ground_truth", "extra_info")
    return names if _takes_any_keyword(sig) else tuple(k for k in names if k in sig.parameters)


def _score(value: object, fn: Callable[..., object], name: str) -> float:
    """``value``, a score ``fn`` returned, as a float: any finite number (a bool, numpy's
    float32 too); else :class:`RewardValueError` naming ``fn`` and where it is defined."""
    if isinstance(value, numbers.Real) and math.isfinite(value):  # numbers.Real: bools and numpy's floats too
        return float(value)
    what = "a finite number" if isinstance(value, numbers.Real) else "a number"
    raise _returned(fn, name, f"{value!r:.80}; expected {what}")


def _returned(fn: Callable[..., object], name: str, what: str) -> RewardValueError:
    """The error for a function ``fn`` that returned ``what``, naming where it is defined."""
    where = defined_at(fn)
    return RewardValueError(f"reward {name or reward_name(fn)!r}{f' ({where})' if where else ''} returned {what}",
                            where)


def _adapt(fn: Callable[..., object], form: str, name: str = "") -> Callable[[Response], float]:
    """``fn`` (written in ``form``) as the one internal call on a :class:`Response`,
    its result checked (:func:`_score`) on the thread that called it."""
    if form == "text":
        return lambda r: _score(settle(fn(r.text, r.answer)), fn, name)
    sig = inspect.signature(fn)
    if form == "verl":
        keywords = _verl_keywords(sig)

        def verl(r: Response) -> float:
            given = {"data_source": r.fields.get("data_source"), "solution_str": r.text, "ground_truth": r.answer,
                     "extra_info": r.fields.get("extra_info")}
            score = settle(fn(**{k: given[k] for k in keywords}))
            if isinstance(score, dict):  # verl's reward managers take result["score"] and log the rest
                if "score" not in score:
                    raise _returned(fn, name, f"a dict without a 'score' key (keys: {', '.join(map(str, score))})")
                score = score["score"]
            return _score(score, fn, name)

        return verl
    any_keyword = _takes_any_keyword(sig)

    def trl(r: Response) -> float:
        completion = [{"role": "assistant", "content": r.text}] if isinstance(r.prompt, list) else r.text
        # as TRL does: every column but the prompt and completion ones, as keyword lists (of one here)
        kwargs = {k: [v] for k, v in r.fields.items() if k not in ("prompt", "completion", "completion_ids")}
        kwargs.update(prompts=[r.prompt], completions=[completion], completion_ids=[list(r.ids)])
        if not any_keyword:
            kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters}
        scores = settle(fn(**kwargs))
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            raise _returned(fn, name, f"{scores!r:.80}; expected a list of one score per completion (here one)")
        return 0.0 if scores[0] is None else _score(scores[0], fn, name)

    return trl
