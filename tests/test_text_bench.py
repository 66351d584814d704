"""The text-task benchmark path on CPU, with a tokenizer built here (no downloads):
a model over a foreign tokenizer (``bench.make_model --tokenizer``), its
supervised warm start (``tools.sft_text``), and ``bench.async_vs_sync`` on
``text_arithmetic``: its task options, held-out eval fields and summary."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from actors.models import load_causal_lm, load_tokenizer
from bench import async_vs_sync
from bench.make_model import TOKENIZER_FILES, VOCAB_MULTIPLE, export_tokenizer, make_model
from policies.tasks import TextArithmetic, make_task
from tests.helpers import build_byte_tokenizer
from tools import sft_text

pytestmark = pytest.mark.timeout(180)

TASK_KWARGS = {"digits": 1, "ops": "+"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level tokenizer with a ChatML template, eos ``<|endoftext|>``, and
    ``<|im_end|>`` as an end-of-turn token: 259 tokens."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    path = tmp_path_factory.mktemp("tiny-text")
    make_model(path, shape="tiny", dtype="float32", tokenizer=tokenizer_dir)
    return path


def test_a_model_over_a_foreign_tokenizer_takes_its_vocab_special_ids_and_files(model_dir, tokenizer_dir):
    tok = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] % VOCAB_MULTIPLE == 0 and len(tok) <= cfg["vocab_size"] < len(tok) + VOCAB_MULTIPLE
    assert cfg["eos_token_id"] == tok.eos_token_id and cfg["pad_token_id"] == tok.pad_token_id
    assert tok.get_vocab() == load_tokenizer(tokenizer_dir).get_vocab()
    # the tokenizer directory had no generation config: one is written with the tokenizer's eos
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    model = load_causal_lm(model_dir)
    assert model.get_input_embeddings().weight.shape[0] == cfg["vocab_size"]
    task = make_task("text_arithmetic", model_path=str(model_dir), **TASK_KWARGS)
    assert task.tokenizer.chat_template and tok.convert_tokens_to_ids("<|im_end|>") in task.stop_token_ids


def test_exporting_a_tokenizer_copies_its_files_and_no_weights(model_dir, tmp_path):
    report = export_tokenizer(model_dir, tmp_path / "tok")
    names = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert names == sorted(report["files"]) and set(names) <= set(TOKENIZER_FILES)
    assert "tokenizer.json" in names and "model.safetensors" not in names
    assert load_tokenizer(tmp_path / "tok").get_vocab() == load_tokenizer(model_dir).get_vocab()
    with pytest.raises(ValueError, match="has no tokenizer"):
        export_tokenizer(tmp_path / "tok" / "..", tmp_path / "again")


def test_sft_labels_are_the_answer_then_the_first_stop_token_after_the_rendered_prompt(model_dir):
    task = make_task("text_arithmetic", model_path=str(model_dir), **TASK_KWARGS)
    prompts = task.sample_prompts(random.Random(0), 3)
    ids, mask, lab = sft_text.sft_batch(task, prompts, pad_id=task.tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        n = len(p.prompt_ids)
        assert ids[i, :n].tolist() == p.prompt_ids and (lab[i, :n] == -100).all()
        answer = [t for t in lab[i, n:].tolist() if t != -100]
        assert answer[-1] == task.stop_token_ids[0] and task.reward(p.meta, answer) == 1.0
        assert int(mask[i].sum()) == n + len(answer)


def test_sft_trains_on_the_training_split_only_is_seeded_and_saves_a_loadable_model(model_dir, tmp_path,
                                                                                      monkeypatch, capsys):
    def no_eval(self, n):
        raise AssertionError("the warm start read the held-out prompts")

    monkeypatch.setattr(TextArithmetic, "eval_prompts", no_eval)
    argv = ["--model", str(model_dir), "--task-kwargs", json.dumps(TASK_KWARGS), "--steps", "4",
            "--batch-size", "4", "--lr", "1e-3", "--eval-prompts", "0", "--seed", "3"]
    assert sft_text.main([*argv, "--out", str(tmp_path / "a")]) == 0
    a = json.loads(capsys.readouterr().out)
    assert sft_text.main([*argv, "--out", str(tmp_path / "b")]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["steps"] == 4 and a["num_params"] > 0 and math.isfinite(a["final_loss"]) and a["seconds"] >= 0
    assert a["final_loss"] == b["final_loss"] and a["first_loss"] == b["first_loss"]
    before, after = load_causal_lm(model_dir).state_dict(), load_causal_lm(tmp_path / "a").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert load_tokenizer(tmp_path / "a").get_vocab() == load_tokenizer(model_dir).get_vocab()


def test_sft_reports_the_held_out_reward_when_asked(model_dir, tmp_path):
    report = sft_text.run(model_dir, task_kwargs=TASK_KWARGS, steps=1, batch_size=2, out=tmp_path,
                          eval_prompts=4, max_new_tokens=4)
    assert 0.0 <= report["eval_reward"] <= 1.0 and report["eval_prompts"] == 4


def test_bench_passes_the_symbol_options_only_to_the_tasks_that_take_them(capsys):
    parse = async_vs_sync.parse_args
    assert async_vs_sync.task_kwargs(parse(["--task", "long_tail_copy", "--tail-alpha", "1.1"])) == \
        {"max_len": 96, "tail_alpha": 1.1}
    assert async_vs_sync.task_kwargs(parse(["--task", "reverse_digits", "--task-max-len", "7"])) == {"max_len": 7}
    text = parse(["--task", "text_arithmetic", "--task-kwargs", '{"ops": "+-*", "tail_alpha": 1.5}'])
    assert async_vs_sync.task_kwargs(text) == {"ops": "+-*", "tail_alpha": 1.5}
    assert async_vs_sync.max_model_len(text) == 256 + text.max_response_tokens
    assert async_vs_sync.max_model_len(parse(["--task", "long_tail_copy"])) == 96 + 16 + 100
    for argv, message in ((["--policies", "sync,fast"], "--policies: unknown 'fast'"),
                          (["--task-kwargs", "[1]"], "expected a JSON object"),
                          (["--task", "nope"], "unknown task 'nope'"),
                          (["--eval-every", "5"], "--eval-every needs --eval-prompts")):
        with pytest.raises(SystemExit):
            async_vs_sync.main(argv)
        assert message in capsys.readouterr().err


def test_a_cuda_run_puts_engine_and_trainer_on_the_device_and_passes_the_task_options_as_json():
    args = async_vs_sync.parse_args(["--device", "cuda", "--runtime", "process", "--task", "text_arithmetic",
                                     "--task-kwargs", '{"ops": "+-*", "digits": 2}', "--eval-prompts", "8",
                                     "--eval-every", "5", "model.path=/m"])
    overrides = async_vs_sync.run_overrides("fully_async", 1, "process", args)
    for item in ("rollout.engine.device=cuda", "trainer.device=cuda", "rollout.engine.dtype=bfloat16",
                 "runtime.type=process", 'task.kwargs.ops="+-*"', "task.kwargs.digits=2",
                 "policy.eval_every=5", "policy.eval_prompts=8", "run.seed=1", "model.path=/m"):
        assert item in overrides
    assert not any(o.startswith(("task.kwargs.max_len", "task.kwargs.tail_alpha")) for o in overrides)
    from actors.config import apply_overrides

    tree = apply_overrides({}, [o for o in overrides if o.startswith("task.kwargs.")])
    assert tree["task"]["kwargs"] == {"ops": "+-*", "digits": 2}


def _run(wall_s: float, tokens: int, reward_last: float) -> dict:
    return {"wall_s": wall_s, "steps_per_s": 10 / wall_s, "tokens_per_s": tokens / wall_s,
            "samples_per_s": 320 / wall_s, "trainer_idle_ratio": 0.1, "rollout_idle_ratio": 0.2,
            "eval_reward_first": 0.1, "eval_reward_last": reward_last, "eval_at_trained": 320,
            "final_reward": 0.5, "first_reward": 0.2, "partial_ratio": 0.0, "sync_ms_mean": 5.0, "eval_s": 0.3}


def test_the_summary_puts_throughput_side_by_side_and_held_out_reward_over_seeds():
    runs = {"sync": [_run(4.0, 800, 0.3), _run(4.0, 800, 0.5)], "fully_async": [_run(2.0, 600, 0.4), _run(2.0, 600, 0.4)]}
    out = async_vs_sync.compare(runs)
    sync = out["policies"]["sync"]
    keys = list(sync)
    assert keys.index("tokens_per_s") == keys.index("steps_per_s") + 1
    assert sync["eval_reward_last"] == {"mean": 0.4, "spread": pytest.approx(0.2), "min": 0.3, "max": 0.5}
    assert sync["eval_at_trained"]["mean"] == out["policies"]["fully_async"]["eval_at_trained"]["mean"] == 320
    # the headline speedup is in trained tokens/s; steps/s beside it
    assert out["speedup_fully_async_over_sync"] == out["speedup_tokens_per_s_fully_async_over_sync"] == \
        pytest.approx(1.5)
    assert out["speedup_steps_per_s_fully_async_over_sync"] == 2.0
    assert out["speedup_fully_async_over_sync_per_seed"] == [1.5, 1.5]
    assert out["speedup_steps_per_s_fully_async_over_sync_per_seed"] == [2.0, 2.0]
    # without evaluations the eval fields are left out, not zero
    bare = {k: v for k, v in _run(4.0, 800, 0.3).items() if not k.startswith("eval")}
    assert "eval_reward_last" not in async_vs_sync.compare({"sync": [bare]})["policies"]["sync"]


def test_bench_runs_the_text_task_and_reports_held_out_reward_at_equal_trained_samples(model_dir, tmp_path, capsys):
    argv = ["--task", "text_arithmetic", "--task-kwargs", json.dumps(TASK_KWARGS), "--seeds", "1",
            "--steps", "2", "--warmup-steps", "1", "--policies", "sync,fully_async", "--batch-prompts", "2",
            "--n", "2", "--max-response-tokens", "6", "--eval-prompts", "3", "--eval-every", "2",
            "--runtime", "local", "--no-warmup-run", "--output-dir", str(tmp_path), f"model.path={model_dir}"]
    assert async_vs_sync.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task_kwargs"] == TASK_KWARGS and "timing" in result and result["eval_in_window"] is True
    for name in ("sync", "fully_async"):
        (run,) = result["policies"][name]["seeds"]
        # before step 1, at step 2 (inside the timed window), after the last step (3)
        assert [step for step, _, _ in run["eval_curve"]] == [0, 2, 3]
        assert run["eval_at_trained"] == 3 * 4 and run["eval_curve"][0][1] == 0
        # the in-window evaluation counts in the timed window (eval_in_window, the default)
        assert run["wall_s"] == run["wall_with_eval_s"] >= run["eval_s"] > 0
        assert 0.0 <= run["eval_reward_last"] <= 1.0 and run["tokens_per_s"] > 0
    assert result["speedup_tokens_per_s_fully_async_over_sync"] > 0


def test_step_by_step_presets_worked_answers_on_text_arithmetic_with_512_response_tokens(model_dir, capsys):
    parse = async_vs_sync.parse_args
    args = parse(["--step-by-step"])
    assert args.task == "text_arithmetic" and args.max_response_tokens == 512
    assert async_vs_sync.task_kwargs(args) == {"instruction": async_vs_sync.STEP_BY_STEP}
    args = parse(["--step-by-step", "--max-response-tokens", "300", "--task-kwargs", '{"digits": 3}'])
    assert args.max_response_tokens == 300 and async_vs_sync.task_kwargs(args)["digits"] == 3
    assert parse(["--task", "text_arithmetic"]).max_response_tokens == 100  # the plain default
    task = make_task("text_arithmetic", model_path=str(model_dir), **async_vs_sync.task_kwargs(parse(["--step-by-step"])))
    (prompt,) = task.sample_prompts(random.Random(0), 1)
    assert "step by step" in task.tokenizer.decode(prompt.prompt_ids)
    with pytest.raises(SystemExit):
        parse(["--step-by-step", "--task", "reverse_digits"])
    assert "--step-by-step: a text_arithmetic preset" in capsys.readouterr().err
