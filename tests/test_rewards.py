import pickle
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from policies.rewards import (FORMS, Response, RewardValueError, TimedReward, anchor_reward_spec, defined_at,
                              exact_match, extract_final_answer, math_answer, parse_number, resolve_reward,
                              reward_form, reward_name)


def R(text: str, answer: str = "", **kw) -> Response:  # noqa: N802 - reads as the call it stands for
    return Response(text=text, answer=answer, **kw)

# --- user reward functions, imported by path ("tests.test_rewards:...") -----------------------

NOT_CALLABLE = 3
_RELEASE = threading.Event()


def always_one(text: str, answer: str) -> float:
    return 1.0


def hangs_on_request(text: str, answer: str) -> float:
    """Hangs (until the test releases it, at most 10 s) when the text says so."""
    if text == "hang":
        _RELEASE.wait(10)
    return 0.5


class Graders:
    @staticmethod
    def length(text: str, answer: str) -> float:
        return min(1.0, len(text) / 10)


@pytest.fixture
def release():
    _RELEASE.clear()
    yield _RELEASE
    _RELEASE.set()  # let abandoned threads finish


# --- exact match ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "answer", "reward"), [
    ("Paris", "Paris", 1.0),
    ("  Paris.\n", "Paris", 1.0),
    ("Paris!?", "Paris.", 1.0),
    ("paris", "Paris", 0.0),  # case-sensitive
    ("Paris, France", "Paris", 0.0),
    ("42", "42.0", 0.0),  # text, not numbers: use the math reward for those
    ("", "", 1.0),
])
def test_exact_match_ignores_surrounding_space_and_trailing_punctuation_only(text, answer, reward):
    assert exact_match(text, answer) == reward


# --- math -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "value"), [
    ("42", 42), ("+42", 42), ("-7", -7), ("42.0", 42), ("3.50", Fraction(7, 2)), (".5", Fraction(1, 2)),
    ("1,234", 1234), ("1,234,567.5", Fraction(2469135, 2)), ("3/4", Fraction(3, 4)), ("-3/4", Fraction(-3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("-\\dfrac{1}{2}", Fraction(-1, 2)), ("$12$", 12), ("\\$12", 12),
    ("50%", 50), ("50\\%", 50), ("1e3", 1000), ("10\\text{ cm}", 10), ("7.", 7), ("\u22125", -5),
    ("1,23", None), ("x", None), ("3/0", None), ("", None), ("1 000", 1000),
])
def test_parse_number_reads_the_usual_ways_of_writing_one(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(("text", "final"), [
    ("so \\boxed{12} or rather \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, nested braces
    ("\\boxed{{a}+{b}}", "{a}+{b}"),
    ("\\boxed 5 apples", "5"),
    ("\\boxed{12", "12"),  # unclosed box: falls through to the last number
    ("She pays 3 * 24 = 72.\n#### 72", "72"),
    ("#### 1,000 dollars\nthat's it", "1,000 dollars"),
    ("First 3, then 4, finally 12.", "12"),
    ("5-3 is 2", "2"), ("x=-3", "-3"), ("3.5 and 7/8", "7/8"),
    ("no numbers here", None),
])
def test_the_final_answer_is_the_last_box_else_after_hashes_else_the_last_number(text, final):
    assert extract_final_answer(text) == final


@pytest.mark.parametrize(("text", "answer", "reward"), [
    ("The answer is 85.", "85", 1.0),
    ("The answer is 85.", "86", 0.0),
    ("We get \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("We get \\boxed{0.75}", "3/4", 1.0),
    ("Total: 1,234 apples", "1234", 1.0),
    ("+7", "7.0", 1.0),
    ("So x = \\boxed{x = 5}", "5", 1.0),
    ("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1.0),  # a GSM8K solution as the answer
    ("it is 8", "the total is \\boxed{8}", 1.0),  # a MATH solution as the answer
    ("The answer is 50%", "50", 1.0),
    ("The answer is \\boxed{B}", "B", 1.0),
    ("The answer is \\boxed{C}", "B", 0.0),
    ("I don't know", "4", 0.0),
    ("4 is wrong, it is 5", "4", 0.0),  # only the final answer counts
    ("-48", "-48", 1.0),
    ("48", "-48", 0.0),
])
def test_math_answer_compares_the_final_answer_as_a_number(text, answer, reward):
    assert math_answer(text, answer) == reward


def test_math_answer_is_fast_on_long_adversarial_text():
    text = "1," * 20000 + "\\boxed{" * 2000 + "9" * 5000 + "#" * 5000
    t0 = time.perf_counter()
    math_answer(text, "1")
    assert time.perf_counter() - t0 < 1.0


# --- user functions by import path ------------------------------------------------------------


def test_builtin_names_resolve_to_the_builtin_functions_unwrapped():
    math = resolve_reward("math", timeout_s=1)
    assert not isinstance(math, TimedReward) and math(R("so \\boxed{0.5}", "1/2")) == 1.0
    assert resolve_reward("exact_match", timeout_s=1)(R("Paris.", "Paris")) == 1.0
    assert reward_form("math") == "text"


def test_a_user_function_is_imported_by_path_and_wrapped_with_a_timeout():
    fn = resolve_reward("tests.test_rewards:always_one", timeout_s=1.0)
    assert isinstance(fn, TimedReward) and fn.timeout_s == 1.0
    assert fn(R("x", "y")) == 1.0
    assert resolve_reward("tests.test_rewards:Graders.length", timeout_s=1.0)(R("hello")) == 0.5


# --- the three forms: this repo's, verl's, TRL's ---------------------------------------------------

ROW = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2 + 3?"}], "solution": "5",
       "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 7}}
SEEN: list = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    SEEN.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str.strip() == ground_truth), "acc": True} if extra_info else 0.25


def verl_without_extra_info(data_source, solution_str, ground_truth):
    return 1.0


def verl_without_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


def trl_reward(completions, **kwargs):
    SEEN.append((completions, kwargs))
    return [None if kwargs["solution"][0] == "n/a" else 1.0 for _ in completions]


def trl_named_columns(completions, solution):  # no **kwargs: gets only what it names
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def trl_two_scores(completions, **kwargs):
    return [1.0, 1.0]


def three_positional(completion, answer, prompt):
    return 1.0


def text_with_keywords(text, answer, **kwargs):
    return 1.0


@pytest.mark.parametrize(("name", "form"), [
    ("always_one", "text"), ("text_with_keywords", "text"), ("compute_score", "verl"),
    ("verl_without_extra_info", "verl"), ("trl_reward", "trl"), ("trl_named_columns", "trl"),
])
def test_the_form_of_a_reward_function_is_told_by_its_parameter_names(name, form):
    assert reward_form(f"tests.test_rewards:{name}") == form


def test_a_signature_that_fits_no_form_is_refused_naming_the_function_and_the_forms():
    with pytest.raises(ValueError) as err:
        reward_form("tests.test_rewards:three_positional")
    message = str(err.value)
    assert message.startswith("reward 'tests.test_rewards:three_positional': its signature "
                              "(completion, answer, prompt) fits none of the accepted forms: ")
    assert all(f"{k} {v}" in message for k, v in FORMS.items()) and "\n" not in message
    with pytest.raises(ValueError, match="fits none of the accepted forms"):
        resolve_reward("tests.test_rewards:three_positional", timeout_s=1.0)


def test_a_verl_compute_score_gets_the_row_s_data_source_and_extra_info_and_may_return_a_dict():
    SEEN.clear()
    fn = resolve_reward("tests.test_rewards:compute_score", timeout_s=1.0)
    assert fn(R(" 5", "5", fields=ROW)) == 1.0  # a dict: its "score"
    assert SEEN == [("gsm8k", " 5", "5", {"index": 7})]
    assert fn(R("5", "5", fields={})) == 0.25  # no such columns: None, as verl's own defaults
    assert resolve_reward("tests.test_rewards:verl_without_extra_info", timeout_s=1.0)(R("5", "5", fields=ROW)) == 1.0
    with pytest.raises(ValueError, match=r"returned a dict without a 'score' key \(keys: acc\)"):
        resolve_reward("tests.test_rewards:verl_without_score", timeout_s=1.0)(R("5", "5", fields=ROW))


def test_a_trl_reward_gets_lists_of_one_with_the_row_s_columns_and_none_scores_zero():
    SEEN.clear()
    fn = resolve_reward("tests.test_rewards:trl_reward", timeout_s=1.0)
    assert fn(R("5", "5", prompt=ROW["prompt"], ids=[3, 9], fields=ROW)) == 1.0
    [(completions, kwargs)] = SEEN
    assert completions == [[{"role": "assistant", "content": "5"}]]  # conversational, as the prompt is
    assert kwargs == {"prompts": [ROW["prompt"]], "completion_ids": [[3, 9]], "data_source": ["gsm8k"],
                      "solution": ["5"], "reward_model": [{"ground_truth": "5"}], "extra_info": [{"index": 7}]}
    SEEN.clear()
    assert fn(R("5", "5", prompt="2 + 3?", fields={"prompt": "2 + 3?", "solution": "n/a"})) == 0.0
    assert SEEN[0][0] == ["5"]  # a text prompt: text completions
    named = resolve_reward("tests.test_rewards:trl_named_columns", timeout_s=1.0)
    assert named(R("5", prompt=ROW["prompt"], fields=ROW)) == 1.0
    with pytest.raises(ValueError, match=r"returned \[1\.0, 1\.0\]; expected a list of one score per completion"):
        resolve_reward("tests.test_rewards:trl_two_scores", timeout_s=1.0)(R("5", fields=ROW))


def test_a_reward_may_be_named_by_its_file_relative_to_the_config_directory(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                           "extra_info=None):\n    return float(solution_str == ground_truth)\n")
    spec = anchor_reward_spec("my_reward.py:compute_score", str(tmp_path))
    assert spec == f"{tmp_path / 'my_reward.py'}:compute_score"
    assert anchor_reward_spec("pkg.mod:fn", str(tmp_path)) == "pkg.mod:fn"
    assert resolve_reward(spec, timeout_s=1.0)(R("5", "5")) == 1.0 and reward_form(spec) == "verl"
    with pytest.raises(ValueError, match=r"reward '.*nope\.py:f': no such file"):
        resolve_reward(str(tmp_path / "nope.py:f"), timeout_s=1.0)
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(ValueError, match=r"cannot import '.*broken\.py': ModuleNotFoundError"):
        resolve_reward(str(tmp_path / "broken.py:f"), timeout_s=1.0)
    with pytest.raises(ValueError, match=r"file '.*my_reward\.py' has no attribute 'other'"):
        resolve_reward(f"{tmp_path / 'my_reward.py'}:other", timeout_s=1.0)


@pytest.mark.parametrize(("spec", "message"), [
    ("nonsense", r"reward 'nonsense': expected one of exact_match, math, an import path 'package\.module:function' "
                 r"or a file 'path/to/file\.py:function'"),
    ("pkg.mod:", "import path"),
    ("no_such_module_xyz:fn", r"reward 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz'"),
    ("tests.test_rewards:missing", r"module 'tests.test_rewards' has no attribute 'missing'"),
    ("tests.test_rewards:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not a function"),
])
def test_a_bad_reward_path_is_a_value_error_naming_it(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(spec, timeout_s=1.0)


def returns_what_it_is_told(text, answer):  # defined on the line RETURNS_LINE names
    return {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "str": "0.5", "none": None,
            "neg": -19, "big": 2, "true": True, "np": np.float32(0.5)}[text]


RETURNS_LINE = returns_what_it_is_told.__code__.co_firstlineno


def reward_len(completions, **kwargs):  # TRL's quick-start reward: negative numbers
    return [-abs(20 - len(completion)) for completion in completions]


def test_any_finite_number_is_a_score_and_what_is_none_raises_naming_the_function_s_file_and_line():
    fn = resolve_reward("tests.test_rewards:returns_what_it_is_told", timeout_s=1.0)
    assert [fn(R(t)) for t in ("neg", "big", "true", "np")] == [-19.0, 2.0, 1.0, 0.5]
    assert resolve_reward("tests.test_rewards:reward_len", timeout_s=1.0)(R("x" * 5)) == -15.0
    for told, expected in [("nan", "nan; expected a finite number"), ("inf", "inf; expected a finite number"),
                           ("-inf", "-inf; expected a finite number"), ("str", "'0.5'; expected a number"),
                           ("none", "None; expected a number")]:
        with pytest.raises(RewardValueError) as err:
            fn(R(told))
        assert str(err.value) == (f"reward 'tests.test_rewards:returns_what_it_is_told' ({__file__}:{RETURNS_LINE}) "
                                  f"returned {expected}")
        assert err.value.location == f"{__file__}:{RETURNS_LINE}"
    with pytest.raises(RewardValueError, match=r"\(.*test_rewards\.py:\d+\) returned \[1\.0, 1\.0\]"):
        resolve_reward("tests.test_rewards:trl_two_scores", timeout_s=1.0)(R("5", fields=ROW))


def test_a_reward_value_error_keeps_its_location_across_processes():
    err = pickle.loads(pickle.dumps(RewardValueError("reward 'f' returned nan", "f.py:3")))
    assert (str(err), err.location) == ("reward 'f' returned nan", "f.py:3")


def test_a_function_itself_is_a_reward_named_by_its_module_and_qualname():
    def local(completions, **kwargs):
        return [len(c) for c in completions]

    fn = resolve_reward(local, timeout_s=1.0)
    assert isinstance(fn, TimedReward) and fn(R("abc")) == 3.0 and reward_form(local) == "trl"
    assert fn.name == reward_name(local) == ("tests.test_rewards:test_a_function_itself_is_a_reward_named_by_its_"
                                             "module_and_qualname.<locals>.local")
    assert defined_at(local) == f"{__file__}:{local.__code__.co_firstlineno}"
    with pytest.raises(ValueError, match="reward: expected a function or a name, got int 3"):
        resolve_reward(3, timeout_s=1.0)


def test_a_user_function_that_raises_raises_to_its_caller():
    def boom(text, answer):
        raise KeyError("no grader")

    with pytest.raises(KeyError, match="no grader"):
        TimedReward(boom, name="boom", timeout_s=1.0)("a", "b")


def test_a_hanging_user_function_times_out_without_holding_its_caller(release):
    fn = resolve_reward("tests.test_rewards:hangs_on_request", timeout_s=0.2)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"reward 'tests.test_rewards:hangs_on_request' took longer than 0.2 s"):
        fn(R("hang"))
    assert 0.2 <= time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    assert fn(R("fine")) == 0.5  # a fresh thread: not queued behind the hung call
    assert time.perf_counter() - t0 < 0.15
    assert fn.num_timeouts == 1


def test_hung_calls_beyond_max_stuck_fail_at_once_until_they_end(release):
    fn = TimedReward(hangs_on_request, name="hangs", timeout_s=0.05, max_stuck=2)
    for _ in range(2):
        with pytest.raises(TimeoutError):
            fn("hang", "")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="2 calls still running after timing out"):
        fn("fine", "")
    assert time.perf_counter() - t0 < 0.05
    release.set()
    for _ in range(100):  # the abandoned threads end and are no longer counted
        if fn._num_stuck == 0:
            break
        time.sleep(0.01)
    assert fn("fine", "") == 0.5
