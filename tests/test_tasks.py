import random
import statistics

import pytest

from policies.tasks import Prompt, make_task, positional_reward


@pytest.fixture(scope="module")
def reverse():
    return make_task("reverse_digits")


def test_reverse_digits_prompts_are_reproducible_and_well_formed(reverse):
    a = reverse.sample_prompts(random.Random(7), 20)
    b = reverse.sample_prompts(random.Random(7), 20)
    assert a == b and all(isinstance(p, Prompt) for p in a)
    tok = reverse.tokenizer
    for p in a:
        text = tok.decode(p.prompt_ids)
        digits = text.removeprefix("<bos>R").removesuffix(":")
        assert text.startswith("<bos>R") and text.endswith(":") and 3 <= len(digits) <= 5
        assert p.meta["answer"] == digits[::-1]


def test_reverse_reward_is_dense_and_needs_eos_for_full_credit(reverse):
    tok = reverse.tokenizer
    eos = tok.eos_token_id
    meta = {"answer": "4321"}
    ids = lambda s: tok.convert_tokens_to_ids(list(s))  # noqa: E731
    assert reverse.reward(meta, ids("4321") + [eos]) == 1.0
    assert reverse.reward(meta, ids("4321")) == 0.5  # never stopped: halved
    assert reverse.reward(meta, ids("4301") + [eos]) == 0.75  # 3 of 4 positions
    assert reverse.reward(meta, ids("43219") + [eos]) == 0.8  # 4 right of 5 emitted
    assert reverse.reward(meta, ids("43") + [eos] + ids("21")) == 0.5  # cut at the first eos
    assert reverse.reward(meta, [eos]) == 0.0


def test_positional_reward_stays_in_unit_interval():
    rng = random.Random(0)
    for _ in range(200):
        ans = [rng.randrange(5) for _ in range(rng.randint(1, 6))]
        resp = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        assert 0.0 <= positional_reward(ans, resp, (5,)) <= 1.0


def test_long_tail_copy_lengths_are_heavy_tailed():
    task = make_task("long_tail_copy", min_len=3, tail_alpha=1.2, max_len=40)
    prompts = task.sample_prompts(random.Random(0), 4000)
    lengths = sorted(len(p.meta["answer"]) for p in prompts)
    median = statistics.median(lengths)
    assert 4 <= median <= 6
    assert lengths[-1] == 40 and lengths[-1] >= 5 * median
    assert sum(n >= 5 * median for n in lengths) / len(lengths) > 0.02  # a real tail, not one outlier
    p = prompts[0]
    assert task.tokenizer.decode(p.prompt_ids) == "<bos>C" + p.meta["answer"] + ":"


def test_unknown_task_and_bad_options_are_named():
    with pytest.raises(ValueError, match="'reverse'"):
        make_task("reverse")
    with pytest.raises(ValueError, match="reverse_digits"):
        make_task("reverse_digits", min_len=6, max_len=2)
    with pytest.raises(ValueError, match="long_tail_copy"):
        make_task("long_tail_copy", nonsense=1)
