"""Text tasks on a tiny byte-level tokenizer with a ChatML chat template, built
by tests/helpers.py (no downloads): rendering, stop tokens, decoding, rewards, held-out
prompts, and a hanging user reward through the rollout actor's scoring path."""

import asyncio
import json
import logging
import pathlib
import random
import threading
import time

import msgspec
import pytest

from policies.config import TaskConfig
from policies.tasks import TextArithmetic, TextDataset, make_task
from tests.helpers import CHATML, build_byte_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN, EVAL = str(ROOT / "examples" / "arithmetic_train.jsonl"), str(ROOT / "examples" / "arithmetic_eval.jsonl")
_RELEASE = threading.Event()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory as far as a text task is concerned: tokenizer files and
    a generation config listing one more eos id."""
    path = tmp_path_factory.mktemp("chat-model")
    build_byte_tokenizer().save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 100]}))
    return str(path)


@pytest.fixture(scope="module")
def tok(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def hangs_on_request(text: str, answer: str) -> float:
    if "hang" in text:
        _RELEASE.wait(10)
    return 1.0 if text.strip() == answer else 0.0


def raises_on_request(text: str, answer: str) -> float:
    if "raise" in text:
        raise RuntimeError("grader crashed")
    return 1.0


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- rendering --------------------------------------------------------------------------------


def test_a_dataset_task_built_from_the_model_directory_renders_prompts_with_the_chat_template(model_dir, tok):
    task = make_task("text_dataset", model_path=model_dir, path=TRAIN, eval_path=EVAL)
    first = json.loads(pathlib.Path(TRAIN).read_text().splitlines()[0])
    prompt = task.sample_prompts(random.Random(0), 200)
    assert {p.meta["answer"] for p in prompt} <= {json.loads(line)["answer"]
                                                   for line in pathlib.Path(TRAIN).read_text().splitlines()}
    rendered = task.tokenizer.decode(task._train[0].prompt_ids)
    assert rendered == f"<|im_start|>user\n{first['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert task._train[0].meta == {"answer": first["answer"], "row": f"{TRAIN}:1"}  # the reward finds its row by it
    assert task.sample_prompts(random.Random(3), 5) == task.sample_prompts(random.Random(3), 5)


def test_a_system_prompt_comes_first_in_chat_and_raw_rendering(tok):
    chat = TextDataset(tok, path=TRAIN, system_prompt="Be brief.")
    assert tok.decode(chat._train[0].prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                           "<|im_start|>user\nWhat is")
    raw = TextDataset(tok, path=TRAIN, system_prompt="Be brief.", chat_template=False)
    first = json.loads(pathlib.Path(TRAIN).read_text().splitlines()[0])["prompt"]
    assert tok.decode(raw._train[0].prompt_ids) == f"Be brief.\n\n{first}"
    assert tok.decode(TextDataset(tok, path=TRAIN, chat_template=False)._train[0].prompt_ids) == first


def test_chat_template_on_a_tokenizer_without_one_is_an_error_that_says_how_to_go_raw():
    plain = build_byte_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="has no chat template; set task.kwargs.chat_template=false"):
        TextArithmetic(plain)
    assert TextArithmetic(plain, chat_template=False).sample_prompts(random.Random(0), 1)


def test_stop_tokens_are_eos_the_generation_config_eos_ids_and_end_of_turn(model_dir, tok):
    task = make_task("text_arithmetic", model_path=model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert task.stop_token_ids == (tok.eos_token_id, 100, im_end)


# --- rewards on decoded text ------------------------------------------------------------------


def test_the_response_is_decoded_without_special_tokens_and_cut_at_its_first_stop(tok):
    task = TextArithmetic(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    response = ids(tok, "3 + 4 = 7, so \\boxed{7}") + [im_end] + ids(tok, "no, 8")
    assert task.decode(response) == "3 + 4 = 7, so \\boxed{7}"
    assert task.reward({"answer": "7"}, response) == 1.0
    assert task.reward({"answer": "8"}, response) == 0.0
    assert task.reward({"answer": "7"}, ids(tok, "<|im_start|>7")) == 1.0  # special tokens skipped
    assert task.reward({"answer": "7"}, []) == 0.0


def test_exact_match_and_user_rewards_are_chosen_by_name(tok):
    exact = TextDataset(tok, path=TRAIN, reward="exact_match")
    assert exact.reward({"answer": "-48"}, ids(tok, " -48.")) == 1.0
    assert exact.reward({"answer": "-48"}, ids(tok, "It is -48")) == 0.0
    user = TextDataset(tok, path=TRAIN, reward="tests.test_text_tasks:raises_on_request")
    assert user.reward({"answer": "x"}, ids(tok, "anything")) == 1.0
    with pytest.raises(ValueError, match="reward 'tests.test_text_tasks:nope'.*no attribute 'nope'"):
        TextDataset(tok, path=TRAIN, reward="tests.test_text_tasks:nope")


# --- chat-message prompts, rows from Python, verl and TRL rewards ------------------------------

CHAT_ROWS = [{"data_source": "toy", "prompt": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "2 + 3?"}],
              "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 0}},
             {"data_source": "toy", "prompt": [{"role": "user", "content": "1 + 1?"}],
              "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 1}}]
SCORED: list = []


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    SCORED.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str == ground_truth)}


def trl_score(completions, prompts, **kwargs):
    SCORED.append((completions, prompts, kwargs["extra_info"]))
    return [float(c[0]["content"] == "5") for c in completions]


def test_chat_message_prompts_render_as_they_are_with_a_system_prompt_only_when_they_have_none(tok):
    task = TextDataset(tok, data=CHAT_ROWS, answer_field="reward_model.ground_truth", system_prompt="Think.")
    assert [tok.decode(p.prompt_ids) for p in task._train] == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\n1 + 1?<|im_end|>\n<|im_start|>assistant\n"]
    assert [p.meta for p in task._train] == [{"answer": "5", "row": "data:row 1"}, {"answer": "2", "row": "data:row 2"}]
    with pytest.raises(ValueError, match=r"data:row 1: the prompt is chat messages, which only a chat template can "
                                         r"render: set task.kwargs.chat_template=true"):
        TextDataset(tok, data=CHAT_ROWS, answer_field="reward_model.ground_truth", chat_template=False)


def test_verl_and_trl_rewards_see_the_row_their_prompt_came_from(tok):
    SCORED.clear()
    verl = TextDataset(tok, data=CHAT_ROWS, eval_data=CHAT_ROWS[1:], answer_field="reward_model.ground_truth",
                       reward="tests.test_text_tasks:verl_score")
    first, held = verl._train[0], verl.eval_prompts(1)[0]
    assert verl.reward(first.meta, ids(tok, "5") + [tok.eos_token_id]) == 1.0
    assert verl.reward(held.meta, ids(tok, "5")) == 0.0
    assert SCORED == [("toy", "5", "5", {"index": 0}), ("toy", "5", "2", {"index": 1})]
    SCORED.clear()
    trl = TextDataset(tok, data=CHAT_ROWS, answer_field="reward_model.ground_truth",
                      reward="tests.test_text_tasks:trl_score")
    assert trl.reward(trl._train[1].meta, ids(tok, "5")) == 1.0
    assert SCORED == [([[{"role": "assistant", "content": "5"}]], [CHAT_ROWS[1]["prompt"]], [{"index": 1}])]


def test_a_dataset_task_needs_exactly_one_source_of_rows(tok):
    for kwargs in ({}, {"path": TRAIN, "data": CHAT_ROWS}, {"data": CHAT_ROWS, "eval_path": EVAL, "eval_data": []}):
        with pytest.raises(ValueError, match="needs one source of rows: path .* or data"):
            TextDataset(tok, answer_field="reward_model.ground_truth", **kwargs)


# --- held-out prompts -------------------------------------------------------------------------


def test_dataset_eval_prompts_are_the_first_rows_of_the_eval_file(tok):
    task = TextDataset(tok, path=TRAIN, eval_path=EVAL)
    answers = [json.loads(line)["answer"] for line in pathlib.Path(EVAL).read_text().splitlines()]
    assert [p.meta["answer"] for p in task.eval_prompts(4)] == answers[:4]
    assert task.eval_prompts(4) == task.eval_prompts(4)
    assert len(task.eval_prompts(1000)) == len(answers)  # all of them when the file has fewer
    with pytest.raises(ValueError, match="has no held-out rows: set task.kwargs.eval_path"):
        TextDataset(tok, path=TRAIN).eval_prompts(4)


def test_arithmetic_eval_prompts_are_fixed_and_never_drawn_in_training(tok):
    a, b = TextArithmetic(tok, digits=1), TextArithmetic(tok, digits=1)
    held = a.eval_prompts(8)
    assert held == b.eval_prompts(8) == a.eval_prompts(8) and len(held) == 8
    assert a.eval_prompts(3) == held[:3]
    train = a.sample_prompts(random.Random(0), 2000)
    assert {tuple(p.prompt_ids) for p in train}.isdisjoint(tuple(p.prompt_ids) for p in held)


def test_symbol_tasks_get_fixed_eval_prompts_and_ignore_the_model_path(model_dir):
    task = make_task("reverse_digits", model_path=model_dir, reward_timeout_s=3.0)
    assert task.eval_prompts(6) == task.eval_prompts(6) == make_task("reverse_digits").eval_prompts(6)
    assert task.eval_prompts(6) != task.sample_prompts(random.Random(0), 6)


# --- bad options ------------------------------------------------------------------------------


def test_max_prompt_tokens_refuses_long_rows_counted_and_logged(tok, tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "short", "answer": "1"}\n{"prompt": "' + "long " * 40 + '", "answer": "2"}\n')
    with caplog.at_level(logging.WARNING, logger="policies.text_tasks"):
        task = TextDataset(tok, path=str(path), chat_template=False, max_prompt_tokens=20)
    assert task.num_refused == {"train": 1} and [p.meta["answer"] for p in task._train] == ["1"]
    assert f"{path}:2" in caplog.text and "refused 1 of 2 rows" in caplog.text
    with pytest.raises(ValueError, match=r"every row's prompt is longer than max_prompt_tokens=2 \(e.g. .*:1\)"):
        TextDataset(tok, path=str(path), chat_template=False, max_prompt_tokens=2)


def test_bad_text_task_options_are_named(tok, model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs the model directory for its tokenizer"):
        make_task("text_arithmetic")
    with pytest.raises(ValueError, match=r"model path '/no/such/model' is not a directory"):
        make_task("text_arithmetic", model_path="/no/such/model")
    with pytest.raises(ValueError, match=r"cannot load a tokenizer from '.*empty'"):
        (tmp_path / "empty").mkdir()
        make_task("text_arithmetic", model_path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="'text_dataset'.*path"):
        make_task("text_dataset", model_path=model_dir)
    with pytest.raises(ValueError, match="option chat_template must be true or false, got 'no'"):
        make_task("text_arithmetic", model_path=model_dir, chat_template="no")
    with pytest.raises(ValueError, match="option reward must be a string or a function, got 1"):
        make_task("text_dataset", model_path=model_dir, path=TRAIN, reward=1)
    with pytest.raises(ValueError, match="option digits must be an integer, got 2.5"):
        make_task("text_arithmetic", model_path=model_dir, digits=2.5)
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: missing field 'answer'"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "q"}\n')
        make_task("text_dataset", model_path=model_dir, path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="bad options for task 'text_arithmetic'.*nonsense"):
        make_task("text_arithmetic", model_path=model_dir, nonsense=1)


def test_task_kwargs_may_not_set_what_the_composition_root_passes():
    with pytest.raises(msgspec.ValidationError, match="kwargs must not set model_path"):
        msgspec.convert({"type": "text_dataset", "kwargs": {"model_path": "m"}}, TaskConfig)


# --- through the rollout actor's scoring path -------------------------------------------------


def _actor(task, timeout_s: float):
    from actors.rollout import RolloutActor

    actor = RolloutActor(engine=None, model_path="", seed=0, make_task=lambda: task, sampling=None,
                         max_response_tokens=8, partial_rollout=True, next_request=None, absorb=None,
                         queue=None, reward_timeout_s=timeout_s)
    actor.task = task  # what setup() does, without an engine
    return actor


def _sample(tok, text: str, answer: str):
    from contracts.sample import Sample

    return Sample(uid=text, group_id="g", prompt_ids=[1], response_ids=ids(tok, text), meta={"answer": answer})


@pytest.mark.timeout(30)
def test_a_hanging_user_reward_is_timed_out_counted_and_frees_the_actor(tok):
    _RELEASE.clear()
    task = make_task("text_dataset", tokenizer=tok, path=TRAIN, reward="tests.test_text_tasks:hangs_on_request",
                     reward_timeout_s=0.3)
    actor = _actor(task, timeout_s=0.3)

    async def scenario():
        hung, good, bad = _sample(tok, "hang", "1"), _sample(tok, "1", "1"), _sample(tok, "2", "1")
        t0 = time.perf_counter()
        await actor._score(hung)
        assert time.perf_counter() - t0 < 1.5
        assert hung.finish_reason == "error" and hung.reward is None and "TimeoutError" in hung.error
        t0 = time.perf_counter()
        await actor._score(good)  # the actor's worker thread is free again, not queued behind the hang
        await actor._score(bad)
        assert time.perf_counter() - t0 < 0.3
        assert (good.reward, bad.reward) == (1.0, 0.0) and good.finish_reason is None
        assert actor.num_reward_errors == 1

    try:
        asyncio.run(scenario())
    finally:
        _RELEASE.set()
        asyncio.run(actor.close())


def test_a_user_reward_that_raises_is_counted_by_the_actor(tok):
    task = make_task("text_dataset", tokenizer=tok, path=TRAIN, reward="tests.test_text_tasks:raises_on_request")
    actor = _actor(task, timeout_s=5.0)

    async def scenario():
        bad, good = _sample(tok, "please raise", "1"), _sample(tok, "fine", "1")
        await actor._score(bad)
        await actor._score(good)
        return bad, good

    try:
        bad, good = asyncio.run(scenario())
    finally:
        asyncio.run(actor.close())
    assert bad.finish_reason == "error" and "RuntimeError: grader crashed" in bad.error
    assert good.reward == 1.0 and actor.num_reward_errors == 1


def scores_as_told(text: str, answer: str) -> float:
    return {"nan": float("nan"), "inf": float("inf"), "neg": -2.5}.get(text.strip(), 1.0)


def test_a_user_reward_of_nan_or_an_infinity_is_counted_naming_where_the_function_is_defined(tok):
    task = make_task("text_dataset", tokenizer=tok, path=TRAIN, reward="tests.test_text_tasks:scores_as_told")
    actor = _actor(task, timeout_s=5.0)
    samples = [_sample(tok, text, "1") for text in ("nan", "inf", "neg", "fine")]

    async def scenario():
        for sample in samples:
            await actor._score(sample)

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(actor.close())
    line = f"{__file__}:{scores_as_told.__code__.co_firstlineno}"
    assert [s.error for s in samples[:2]] == [
        f"reward: RewardValueError: reward 'tests.test_text_tasks:scores_as_told' ({line}) returned {v}; expected a "
        "finite number" for v in ("nan", "inf")]  # the user's line, not this project's, and only once
    assert [s.reward for s in samples[2:]] == [-2.5, 1.0] and actor.num_reward_errors == 2


def test_a_dataset_needs_an_answer_field_only_for_a_reward_that_reads_one(tok):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "level": 3}]
    task = TextDataset(tok, data=rows, reward=trl_score)  # a function itself, in TRL's form: no answer read
    assert task._train[0].meta == {"answer": "", "row": "data:row 1"}
    with pytest.raises(ValueError, match=r"data:row 1: missing field 'answer' \(fields: prompt, level\)"):
        TextDataset(tok, data=rows, reward="math")


class _FakeTask:
    """A FAKE task for the scoring path alone: its reward is 1 for a response of
    length 1, else 0, and blocks while ``hold`` is clear (the thread it runs on)."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()
        self.threads: set[int] = set()

    def reward(self, meta, response_ids) -> float:
        self.threads.add(threading.get_ident())
        self.hold.wait(10)
        return float(len(response_ids) == 1)


def _scored_sample(i: int, n: int):
    from contracts.sample import Sample

    return Sample(uid=f"s{i}", group_id="g", prompt_ids=[1], response_ids=[7] * n)


def test_samples_finishing_together_are_scored_at_once_on_the_reward_pool():
    task = _FakeTask()
    actor = _actor(task, timeout_s=5.0)

    async def scenario():
        samples = [_scored_sample(i, 1 + i % 2) for i in range(8)]
        await asyncio.gather(*(actor._score(s) for s in samples))  # finished together, as one engine turn ends them
        late = _scored_sample(8, 1)
        await actor._score(late)
        return samples + [late]

    try:
        samples = asyncio.run(scenario())
    finally:
        asyncio.run(actor.close())
    assert [s.reward for s in samples] == [1.0, 0.0] * 4 + [1.0] and actor.num_reward_errors == 0
    assert actor.num_reward_calls == 9 and actor.num_scoring == 0


def test_a_closing_actor_cancels_who_waits_for_a_score_instead_of_leaving_it_waiting():
    task = _FakeTask()
    task.hold.clear()  # the reward blocks until the test lets it go
    actor = _actor(task, timeout_s=5.0)

    async def scenario():
        waiting = asyncio.ensure_future(actor._score(_scored_sample(0, 1)))
        while not task.threads:  # the call is on a thread of the pool
            await asyncio.sleep(0.01)
        waiting.cancel()  # what the loop's shutdown does to a task left running
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 5)
        assert actor.num_scoring == 0
        t0 = time.monotonic()
        await actor.close()  # the blocked call is abandoned, not waited for past the pool's short wait
        assert time.monotonic() - t0 < 3

    try:
        asyncio.run(scenario())
    finally:
        task.hold.set()


def test_a_chat_template_that_refuses_a_system_turn_is_a_named_error():
    strict = build_byte_tokenizer(chat_template="{% if messages[0]['role'] == 'system' %}"
                                  "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML)
    assert TextArithmetic(strict).eval_prompts(1)
    with pytest.raises(ValueError, match="chat template cannot render a prompt with a system_prompt.*System role"):
        TextArithmetic(strict, system_prompt="Be brief.")
