"""Bring your own data and reward: what verl and TRL users have trains a few real
steps unchanged (the built-in tiny model, given a chat template that writes the
messages' contents after BOS, so chat prompts become the digit prompts it was
trained on), and what cannot work is refused on load, in one line."""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil

import pytest

from actors.config import ConfigError, load_config
import loop
from actors.launch import launch
from policies.reward_guard import RewardsFailing
from tests.extras import needs_mark

ROOT = pathlib.Path(__file__).resolve().parents[1]
# temperature 0.2: the tiny model's near-greedy answers are often exactly right (at 1.0 seldom), so a
# reward that never reached the run would show as a sum of 0
SHORT = ["run.total_steps=3", "trainer.batch_prompts=2", "rollout.n=4", "run.progress=false",
         "rollout.max_response_tokens=8", "rollout.temperature=0.2"]
DIGITS = ["314", "2718", "1618", "5772", "4669", "1414", "8573", "2236"]
CONTENTS_AFTER_BOS = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
TRL_CALLS: list[int] = []


def trl_conversational(completions, solution, **kwargs):
    """A TRL reward over conversational data: completions are assistant messages."""
    TRL_CALLS.append(len(completions))
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def trl_standard(completions, prompts, answer, **kwargs):
    """A TRL reward over plain-text prompts: completions are strings; None is "not applicable"."""
    TRL_CALLS.append(len(completions))
    return [None if p.startswith("R0") else float(c == a) for c, p, a in zip(completions, prompts, answer)]


def three_positional(completion, answer, prompt):
    return 1.0


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-chat")
    for f in (ROOT / "actors" / "assets" / "tiny-qwen2").iterdir():
        shutil.copy(f, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CONTENTS_AFTER_BOS}))
    return str(path)


def _verl_rows(digits: list[str]) -> list[dict]:
    return [{"data_source": "reverse_digits", "prompt": [{"role": "user", "content": f"R{d}:"}],
             "ability": "reverse", "reward_model": {"style": "rule", "ground_truth": d[::-1]},
             "extra_info": {"split": "train", "index": i}} for i, d in enumerate(digits)]


def _train(*overrides: str, tmp_path: pathlib.Path, bounds: tuple[float, float] = (0.0, 1.0),
           **data: object) -> list[dict]:
    """Three steps; every sample scored (none dropped for its reward), each step's
    mean reward within ``bounds``; the records."""
    run = launch(ROOT / "fully_async.yaml", *SHORT, *overrides, f"run.output_dir={tmp_path / 'runs'}", **data)
    with run:
        records = run.train(steps=3)
        run.check()
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert not {"reward_error", "reward_timeout"} & set(m["dropped"]), m["dropped"]
        assert bounds[0] <= m["reward"] <= bounds[1]
    return records


@needs_mark("pyarrow", "parquet")
def test_a_verl_parquet_file_and_a_verl_compute_score_train_unchanged(chat_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(DIGITS)), data)
    records = _train(f"model.path={chat_model}", "task.type=text_dataset", f"task.kwargs.path={data}",
                     "task.kwargs.answer_field=reward_model.ground_truth",
                     "task.kwargs.reward=examples/verl_reward.py:compute_score",  # relative to the config's directory
                     tmp_path=tmp_path)
    assert sum(m["reward"] for m in records) > 0  # the trained reverser gets some right: the score reached the run


@needs_mark("datasets", "datasets")
def test_a_trl_reward_over_a_datasets_dataset_passed_from_python_trains(chat_model, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"R{d}:"}], "solution": d[::-1]}
                                     for d in DIGITS])
    TRL_CALLS.clear()
    records = _train(f"model.path={chat_model}", "task.type=text_dataset", "task.kwargs.answer_field=solution",
                     "task.kwargs.reward=tests.test_byo_data:trl_conversational", tmp_path=tmp_path, data=ds)
    assert set(TRL_CALLS) == {1} and len(TRL_CALLS) >= records[-1]["trained"]  # per sample, lists of one
    assert sum(m["reward"] for m in records) > 0


@needs_mark("datasets", "datasets")
def test_a_save_to_disk_directory_with_text_prompts_and_a_trl_reward_trains(chat_model, tmp_path):
    import datasets

    rows = [{"prompt": f"R{d}:", "answer": d[::-1]} for d in DIGITS] + [{"prompt": "R012:", "answer": "210"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    TRL_CALLS.clear()
    records = _train(f"model.path={chat_model}", "task.type=text_dataset", f"task.kwargs.path={tmp_path / 'ds'}",
                     "task.kwargs.reward=tests.test_byo_data:trl_standard", tmp_path=tmp_path)
    assert TRL_CALLS and sum(m["reward"] for m in records) > 0


@needs_mark("pyarrow", "parquet")
def test_a_row_missing_a_nested_field_stops_the_launch_naming_file_row_and_path(chat_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def launch_nested(data: pathlib.Path) -> None:
        launch(ROOT / "fully_async.yaml", *SHORT, f"model.path={chat_model}", "task.type=text_dataset",
               f"task.kwargs.path={data}", "task.kwargs.answer_field=reward_model.ground_truth",
               f"run.output_dir={tmp_path / 'runs'}")

    rows = _verl_rows(DIGITS[:3])
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    with pytest.raises(ValueError) as err:
        launch_nested(data)
    assert str(err.value) == (f"{data}:row 3: field 'reward_model.ground_truth' must be a string or a number, "
                              "got null")
    data = tmp_path / "flat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], {"prompt": "R1:", "reward_model": {}}]))
    with pytest.raises(ValueError) as err:
        launch_nested(data)
    assert str(err.value) == (f"{data}:2: missing field 'reward_model.ground_truth' "
                              "(no 'ground_truth' in 'reward_model'; it has: nothing)")


def test_a_reward_whose_signature_fits_no_form_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "fully_async.yaml", ["task.type=text_dataset", "task.kwargs.path=x.jsonl",
                                                "task.kwargs.reward=tests.test_byo_data:three_positional"])
    assert str(err.value) == (
        "task.kwargs.reward: reward 'tests.test_byo_data:three_positional': its signature "
        "(completion, answer, prompt) fits none of the accepted forms: text (text, answer); "
        "verl (data_source, solution_str, ground_truth, extra_info=None); trl (completions, **kwargs)")


def test_the_example_config_loads_its_verl_files_and_reward():
    cfg = load_config(ROOT / "examples" / "verl_parquet.yaml")
    assert cfg.task.kwargs["reward"] == f"{ROOT / 'examples' / 'verl_reward.py'}:compute_score"
    import policies.rewards

    assert policies.rewards.reward_form(cfg.task.kwargs["reward"]) == "verl"


@needs_mark("pyarrow", "parquet")
def test_the_example_verl_files_load_with_their_nested_answer():
    from policies.datasets import load_rows

    for split in ("train", "eval"):
        rows = load_rows(ROOT / "examples" / f"verl_arithmetic_{split}.parquet",
                         answer_field="reward_model.ground_truth")
        assert rows and all(r.prompt[0]["role"] == "user" and r.answer.lstrip("-").isdigit() for r in rows)
        assert {r.fields["data_source"] for r in rows} == {"asyncrl/arithmetic"}


# -- TRL's rewards as TRL writes them; a reward passed to launch; rewards that are no number ----------------------


def reward_len(completions, **kwargs):
    """TRL's quick-start reward, as its documentation writes it: negative numbers."""
    return [-abs(20 - len(completion)) for completion in completions]


@needs_mark("datasets", "datasets")
def test_trls_quick_start_reward_len_over_a_conversational_dataset_without_answers_trains_three_steps(
        chat_model, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"R{d}:"}]} for d in DIGITS])
    assert ds.column_names == ["prompt"]  # no answer column: TRL's form reads none
    records = _train(f"model.path={chat_model}", "task.type=text_dataset",
                     "task.kwargs.reward=tests.test_byo_data:reward_len", tmp_path=tmp_path, bounds=(-20.0, 0.0),
                     data=ds)
    # a conversational completion is a list of one message (len 1): every score is -19, and it reached the run
    assert [m["reward"] for m in records] == [-19.0] * 3


def test_a_reward_function_passed_to_launch_trains_in_child_processes_too(chat_model, tmp_path):
    offset = 1.0

    def negative_length(completions, **kwargs):  # a closure: no child process could find it by name
        return [-(offset + len(c)) for c in completions]

    rows = [{"prompt": f"R{d}:"} for d in DIGITS]  # TRL's standard format: text prompts, text completions
    records = _train(f"model.path={chat_model}", "task.type=text_dataset", "runtime.type=process",
                     tmp_path=tmp_path, bounds=(-100.0, -1.0), data=rows, reward=negative_length)
    assert any(m["reward"] < -1.0 for m in records)  # responses' lengths: scored by the function, in the children
    [saved] = (tmp_path / "runs").glob("*/config.yaml")
    assert ("reward: tests.test_byo_data:test_a_reward_function_passed_to_launch_trains_in_child_processes_too."
            "<locals>.negative_length") in saved.read_text()  # the run's config records which function it was


def test_a_run_trained_with_a_closure_as_its_reward_resumes_when_it_is_passed_again(chat_model, tmp_path):
    def minus_one(completions, **kwargs):
        return [-1.0 for _ in completions]

    start = [f"model.path={chat_model}", "task.type=text_dataset", "run.checkpoint_every=1"]
    data = [{"prompt": f"R{d}:"} for d in DIGITS]
    with launch(ROOT / "fully_async.yaml", *SHORT, *start, f"run.output_dir={tmp_path}", data=data,
                reward=minus_one) as run:
        run.train(steps=1)
    with pytest.raises(ValueError, match=r"<locals>\.minus_one': a function defined inside another .* pass the "
                                         r"function itself again: launch\(\.\.\., reward=fn\)"):
        launch(None, resume=run.dir, data=data)
    with launch(None, resume=run.dir, data=data, reward=minus_one) as resumed:
        assert [m["reward"] for m in resumed.train(steps=1)] == [-1.0]


def test_a_reward_passed_to_launch_must_be_a_function_the_task_takes():
    with pytest.raises(ValueError, match=r"^launch\(reward=...\): expected a function, got str 'math'"):
        launch(ROOT / "fully_async.yaml", reward="math")
    with pytest.raises(ValueError, match=r"^launch\(reward=...\): task 'reverse_digits' takes no reward function"):
        launch(ROOT / "fully_async.yaml", reward=reward_len)
    with pytest.raises(ValueError, match=r"^launch\(reward=...\): reward 'tests.test_byo_data:three_positional': "
                                         r"its signature \(completion, answer, prompt\) fits none"):
        launch(ROOT / "fully_async.yaml", "task.type=text_dataset", reward=three_positional)


_CALLS = itertools.count()


def nan_then_inf_then_lengths(completions, **kwargs):
    """NaN on its first call, an infinity on its second, then the completion's length."""
    call = next(_CALLS)
    return [float("nan") if call == 0 else float("inf") if call == 1 else float(len(completions[0]))]


def test_a_nan_or_infinite_reward_is_a_counted_error_of_its_sample_and_the_run_goes_on(chat_model, tmp_path):
    global _CALLS
    _CALLS = itertools.count()  # the function runs here (local runtime)
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"model.path={chat_model}", "task.type=text_dataset",
                 f"run.output_dir={tmp_path}", data=[{"prompt": f"R{d}:"} for d in DIGITS],
                 reward=nan_then_inf_then_lengths)
    with run:
        records = run.train(steps=3)
        run.check()
        # counted as a reward that raises is: each sample's own error, its group dropped, in the metrics
        assert records[-1]["dropped"]["reward_error"] == 2
        assert records[-1]["dropped"]["group_incomplete"] in (2, 6)  # one group, or two
        assert [loop.run(h.statistics())["num_reward_errors"] for h in run.policy.rollouts] == [2]
        line = f"{__file__}:{nan_then_inf_then_lengths.__code__.co_firstlineno}"
        assert run.policy.reward_guard.last_error in [  # the latest failed group's first: shown if the run stops
            f"RewardValueError: reward 'tests.test_byo_data:nan_then_inf_then_lengths' ({line}) returned {v}; "
            "expected a finite number" for v in ("nan", "inf")]


def always_nan(completions, **kwargs):
    return [float("nan")]


def always_raises(text, answer):
    raise KeyError("no grader for this row")


@pytest.mark.parametrize(("reward", "where"), [
    (always_nan, f"({__file__}:{always_nan.__code__.co_firstlineno}) returned nan; expected a finite number"),
    (always_raises, f"KeyError: 'no grader for this row' ({__file__}:{always_raises.__code__.co_firstlineno + 1})"),
])
def test_a_reward_error_s_line_names_the_user_s_file_and_line(chat_model, tmp_path, reward, where):
    run = launch(ROOT / "fully_async.yaml", *SHORT, f"model.path={chat_model}", "task.type=text_dataset",
                 f"run.output_dir={tmp_path}", data=[{"prompt": f"R{d}:", "answer": d} for d in DIGITS],
                 reward=reward)
    with run, pytest.raises(RewardsFailing) as err:
        run.train(steps=3)
    assert where in str(err.value) and "\n" not in str(err.value)
