import json
import pathlib
import random
import sys

import pytest

from policies.datasets import ArithmeticProblems, Row, load_rows
from tests.extras import needs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _write(path: pathlib.Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_jsonl_rows_load_in_order_with_numbers_as_text_and_blank_lines_ignored(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"prompt": "What is 1 + 1?", "answer": "2", "id": 7}', "",
                  '{"prompt": "What is 2 * 3?", "answer": 6}', '{"prompt": "Half?", "answer": 0.5}')
    rows = load_rows(path)
    assert rows == [Row(prompt="What is 1 + 1?", answer="2", where=f"{path}:1"),
                    Row(prompt="What is 2 * 3?", answer="6", where=f"{path}:3"),
                    Row(prompt="Half?", answer="0.5", where=f"{path}:4")]


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
    ('{"prompt": "q", "answer": ', r"bad\.jsonl:2: not JSON \(.* at column \d+\)"),
    ('["q", "a"]', r"bad\.jsonl:2: expected a JSON object with fields 'prompt' and 'answer', got a list"),
    ('{"prompt": "q"}', r"bad\.jsonl:2: missing field 'answer' \(fields: prompt\)"),
    ('{"answer": "a"}', r"bad\.jsonl:2: missing field 'prompt'"),
    ('{"prompt": 12, "answer": "a"}', r"bad\.jsonl:2: field 'prompt' must be a string, got a number"),
    ('{"prompt": ["hi"], "answer": "a"}', r"bad\.jsonl:2: field 'prompt' must be a string, got a list"),
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
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: field 'prompt' must be a string, got null"):
        load_rows(bad)
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["1"]}), nocol)
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: question, answer\)"):
        load_rows(nocol)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(ValueError, match="the file has no rows"):
        load_rows(empty)


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
