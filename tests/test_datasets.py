import json
import pathlib
import random
import sys

import pytest

from policies.datasets import ArithmeticProblems, load_rows
from tests.extras import needs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write(path: pathlib.Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_jsonl_rows_load_in_order_with_numbers_as_text_and_blank_lines_ignored(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"prompt": "What is 1 + 1?", "answer": "2", "id": 7}', "",
                  '{"prompt": "What is 2 * 3?", "answer": 6}', '{"prompt": "Half?", "answer": 0.5}')
    rows = load_rows(path)
    assert [(r.prompt, r.answer, r.where) for r in rows] == [("What is 1 + 1?", "2", f"{path}:1"),
                                                            ("What is 2 * 3?", "6", f"{path}:3"),
                                                            ("Half?", "0.5", f"{path}:4")]
    assert rows[0].fields == {"prompt": "What is 1 + 1?", "answer": "2", "id": 7}  # every column, for rewards


def test_field_names_are_configurable(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"question": "q", "solution": "s"}')
    assert load_rows(path, prompt_field="question", answer_field="solution")[0].answer == "s"
    with pytest.raises(ValueError, match=r"d\.jsonl:1: missing field 'prompt' \(fields: question, solution\)"):
        load_rows(path)


def test_a_missing_file_is_named_with_where_it_was_looked_for(tmp_path):
    with pytest.raises(ValueError, match=r"dataset 'nope\.jsonl': no such file \(looked for /.*nope\.jsonl\)"):
        load_rows("nope.jsonl")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"dataset '.*empty\.jsonl': the file has no rows"):
        load_rows(path)


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "q", "answer": ', r"bad\.jsonl:2: not JSON \(Expecting value at the end of the line\)"),
    ('["q", "a"]', r"bad\.jsonl:2: expected a JSON object with fields 'prompt' and 'answer', got a list"),
    ('{"prompt": "q"}', r"bad\.jsonl:2: missing field 'answer' \(fields: prompt\)"),
    ('{"answer": "a"}', r"bad\.jsonl:2: missing field 'prompt'"),
    ('{"prompt": 12, "answer": "a"}', r"bad\.jsonl:2: field 'prompt' must be a string or a list of chat messages, "
                                      "got a number"),
    ('{"prompt": ["hi"], "answer": "a"}', r"bad\.jsonl:2: field 'prompt': message 0 must be an object with a "
                                          "string 'role' and a string 'content', got 'hi'"),
    ('{"prompt": [], "answer": "a"}', r"bad\.jsonl:2: field 'prompt' is an empty list of chat messages"),
    ('{"prompt": "q", "answer": null}', r"bad\.jsonl:2: field 'answer' must be a string or a number, got null"),
    ('{"prompt": "q", "answer": true}', r"bad\.jsonl:2: field 'answer' must be a string or a number, got a boolean"),
    ('{"prompt": "  ", "answer": "a"}', r"bad\.jsonl:2: field 'prompt' is empty"),
    ('{"prompt": "q", "answer": ""}', r"bad\.jsonl:2: field 'answer' is empty"),
])
def test_a_bad_row_is_an_error_naming_file_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", '{"prompt": "fine", "answer": "1"}', line, '{"prompt": "x", "answer": "2"}')
    with pytest.raises(ValueError, match=message):
        load_rows(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl': not UTF-8"):
        load_rows(path)


def test_parquet_without_pyarrow_names_the_missing_package(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails as when not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"d\.parquet'.*needs pyarrow \(install the optional extra: pip install -e \"\.\[parquet\]\"\)"):
        load_rows(path)


def test_parquet_rows_load_and_a_bad_row_is_named(tmp_path):
    pa = needs("pyarrow", "parquet")
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "extra": [1, 2]}), good)
    assert [r.answer for r in load_rows(good)] == ["1", "2"]
    assert load_rows(good)[1].where == f"{good}:row 2"
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: field 'prompt' must be a string or a list of chat "
                                         "messages, got null"):
        load_rows(bad)
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), nocol)
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: question, answer\)"):
        load_rows(nocol)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(ValueError, match="the file has no rows"):
        load_rows(empty)


# --- chat messages, nested fields, datasets -----------------------------------------------------

VERL_ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"split": "train", "index": 0}}


def test_a_prompt_may_be_chat_messages_and_fields_dotted_paths_into_nested_records(tmp_path):
    path = _write(tmp_path / "verl.jsonl", json.dumps(VERL_ROW))
    [row] = load_rows(path, answer_field="reward_model.ground_truth")
    assert row.prompt == VERL_ROW["prompt"] and row.answer == "5" and row.fields == VERL_ROW
    flat = _write(tmp_path / "flat.jsonl", '{"prompt": "q", "a.b": "flat", "a": {"b": "nested"}}')
    assert load_rows(flat, answer_field="a.b")[0].answer == "flat"  # a key holding the dots is taken first


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "q", "reward_model": {"style": "rule"}},
     r"d\.jsonl:2: missing field 'reward_model\.ground_truth' \(no 'ground_truth' in 'reward_model'; it has: style\)"),
    ({"prompt": "q", "reward_model": "5"},
     r"d\.jsonl:2: missing field 'reward_model\.ground_truth' \(no 'ground_truth' in 'reward_model'; it is a string\)"),
    ({"prompt": "q"}, r"d\.jsonl:2: missing field 'reward_model\.ground_truth' \(fields: prompt\)"),
])
def test_a_nested_path_missing_in_a_row_names_the_file_the_row_and_the_path(tmp_path, record, message):
    path = _write(tmp_path / "d.jsonl", json.dumps(VERL_ROW), json.dumps(record))
    with pytest.raises(ValueError, match=message) as err:
        load_rows(path, answer_field="reward_model.ground_truth")
    assert "\n" not in str(err.value)


def test_verl_parquet_rows_load_with_their_nested_columns(tmp_path):
    pa = needs("pyarrow", "parquet")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule",
                                                                               "ground_truth": None}}]), path)
    with pytest.raises(ValueError, match=r"train\.parquet:row 2: field 'reward_model\.ground_truth' must be a "
                                         "string or a number, got null"):
        load_rows(path, answer_field="reward_model.ground_truth")
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), path)
    [row] = load_rows(path, answer_field="reward_model.ground_truth")
    assert (row.prompt, row.answer, row.where) == (VERL_ROW["prompt"], "5", f"{path}:row 1")
    assert row.fields["extra_info"] == {"split": "train", "index": 0}
    with pytest.raises(ValueError, match=r"no column 'solution\.value' \(columns: data_source, prompt, ability"):
        load_rows(path, answer_field="solution.value")


def test_rows_come_from_a_list_of_dicts_a_dataset_or_its_save_to_disk_directory(tmp_path):
    records = [{"prompt": [{"role": "user", "content": "2 + 3?"}], "solution": "5"},
               {"prompt": [{"role": "user", "content": "1 + 1?"}], "solution": 2}]
    rows = load_rows(records, answer_field="solution")
    assert [(r.answer, r.where) for r in rows] == [("5", "data:row 1"), ("2", "data:row 2")]
    with pytest.raises(ValueError, match=r"eval_data:row 2: missing field 'solution'"):
        load_rows([records[0], {"prompt": "q"}], answer_field="solution", name="eval_data")
    with pytest.raises(ValueError, match="dataset 'data': no rows"):
        load_rows([])
    datasets = needs("datasets", "datasets")
    ds = datasets.Dataset.from_list([{**r, "solution": str(r["solution"])} for r in records])
    assert [r.answer for r in load_rows(ds, answer_field="solution")] == ["5", "2"]
    with pytest.raises(ValueError, match=r"dataset 'data': no column 'answer' \(columns: prompt, solution\)"):
        load_rows(ds)
    ds.save_to_disk(str(tmp_path / "ds"))
    rows = load_rows(tmp_path / "ds", answer_field="solution")
    assert [(r.prompt, r.answer) for r in rows] == [(records[0]["prompt"], "5"), (records[1]["prompt"], "2")]
    assert rows[0].where == f"{tmp_path / 'ds'}:row 1"
    splits = datasets.DatasetDict({"train": ds, "test": ds})
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"holds the splits train, test: give one split's directory, "
                                         r"e\.g\. '.*splits/train'"):
        load_rows(tmp_path / "splits")
    with pytest.raises(ValueError, match=r"is a mapping \(train, test\), not rows: give one split"):
        load_rows(splits)


def test_rows_need_no_answer_field_when_the_reward_reads_none(tmp_path):
    chat = [{"role": "user", "content": "Say hi"}]
    records = [{"prompt": chat}, {"prompt": "Count", "answer": 3}, {"prompt": "Odd", "answer": ["a list"]}]
    rows = load_rows(records, answer_required=False)
    assert [(r.prompt, r.answer) for r in rows] == [(chat, ""), ("Count", "3"), ("Odd", "")]
    assert rows[2].fields == records[2]  # the column itself still reaches a TRL reward, as it is
    path = _write(tmp_path / "d.jsonl", '{"prompt": "a"}')
    assert load_rows(path, answer_required=False)[0].answer == ""
    with pytest.raises(ValueError, match=r":1: missing field 'answer'"):
        load_rows(path)
    datasets = needs("datasets", "datasets")
    ds = datasets.Dataset.from_list([{"prompt": chat}])  # no answer column: refused only when it is needed
    assert load_rows(ds, answer_required=False)[0].answer == ""
    with pytest.raises(ValueError, match="dataset 'data': no column 'answer' \\(columns: prompt\\)"):
        load_rows(ds)


def test_a_datasets_directory_without_the_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the datasets package \(install the optional extra: "
                                         r"pip install -e \"\.\[datasets\]\"\)"):
        load_rows(tmp_path / "ds")


# --- the built-in arithmetic generator --------------------------------------------------------


def test_arithmetic_answers_follow_operator_precedence():
    gen = ArithmeticProblems(digits=3, num_operands=4, ops="+-*", instruction="")
    rng = random.Random(0)
    for _ in range(300):
        row = gen.sample(rng)
        expr = row.prompt.removeprefix("What is ").removesuffix("?")
        assert int(row.answer) == eval(expr)  # noqa: S307 - the test's own oracle on digits and + - *


def test_training_never_draws_a_held_out_problem_and_the_split_is_stable():
    gen = ArithmeticProblems(digits=1, num_operands=2, ops="+-", eval_fraction=0.2)
    held = gen.held_out(1000)  # the whole held-out split of a 200-problem space
    assert 10 <= len(held) <= 70 and len({r.prompt for r in held}) == len(held)
    assert held == ArithmeticProblems(digits=1, num_operands=2, ops="+-", eval_fraction=0.2).held_out(1000)
    assert gen.held_out(5) == held[:5]  # the first n: the same on every call
    rng = random.Random(1)
    train = {gen.sample(rng).prompt for _ in range(3000)}
    assert train.isdisjoint(r.prompt for r in held)
    assert len(train) == 200 - len(held)  # and everything else is drawn


def test_tail_alpha_gives_a_heavy_tail_of_answer_lengths():
    flat = ArithmeticProblems(digits=2)
    tail = ArithmeticProblems(digits=2, tail_alpha=1.0, max_digits=12)
    rng = random.Random(0)
    assert max(len(flat.sample(rng).answer.lstrip("-")) for _ in range(500)) <= 3
    lengths = sorted(len(tail.sample(rng).answer.lstrip("-")) for _ in range(4000))
    assert lengths[len(lengths) // 2] <= 4 and lengths[-1] >= 12
    assert sum(n >= 8 for n in lengths) / len(lengths) > 0.1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"digits": 0}, "digits"), ({"num_operands": 1}, "num_operands"), ({"ops": "+/"}, "ops"),
    ({"tail_alpha": -1.0}, "tail_alpha"), ({"eval_fraction": 1.0}, "eval_fraction"),
    ({"digits": 13, "max_digits": 12}, "max_digits"),
])
def test_bad_arithmetic_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticProblems(**kwargs)


def test_the_example_files_load_and_their_eval_rows_are_the_held_out_split():
    train = load_rows(ROOT / "examples" / "arithmetic_train.jsonl")
    held = load_rows(ROOT / "examples" / "arithmetic_eval.jsonl")
    gen = ArithmeticProblems()
    assert len(train) >= 24 and len(held) >= 8
    assert [r.prompt for r in held] == [r.prompt for r in gen.held_out(len(held))]
    expr = lambda row: row.prompt.removeprefix("What is ").split("?")[0]  # noqa: E731
    assert not any(gen.is_held_out(expr(r)) for r in train)
    assert all(json.loads(line).keys() == {"prompt", "answer"}
               for line in (ROOT / "examples" / "arithmetic_train.jsonl").read_text().splitlines())
