"""Bring your own data and reward: what verl and TRL users have trains a few real
steps unchanged (the built-in tiny model, given a chat template that writes the
messages' contents after BOS, so chat prompts become the digit prompts it was
trained on), and what cannot work is refused on load, in one line."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from actors.config import ConfigError, load_config
from actors.launch import launch
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


def _train(*overrides: str, tmp_path: pathlib.Path, **data: object) -> list[dict]:
    """Three steps; every sample scored (none dropped for its reward); the records."""
    run = launch(ROOT / "fully_async.yaml", *SHORT, *overrides, f"run.output_dir={tmp_path / 'runs'}", **data)
    with run:
        records = run.train(steps=3)
        run.check()
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert not {"reward_error", "reward_timeout"} & set(m["dropped"]), m["dropped"]
        assert 0.0 <= m["reward"] <= 1.0
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
