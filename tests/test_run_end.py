"""What a run leaves behind (issue 46 item 4): a finished default run has its final
weights (``run.save_final``), so ``actors.export`` writes a model transformers
loads and ``actors.evaluate`` scores it in one JSON line; ``samples.jsonl`` holds a
few completions with their rewards; the run directory is named when the run
starts."""

from __future__ import annotations

import io
import json
import pathlib
from contextlib import redirect_stdout

import pytest
import torch
import transformers

from actors import evaluate, export
from actors.cli import main
from actors.launch import launch

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "fully_async.yaml")
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[pathlib.Path, list[str]]:
    """A default run of 3 steps from the command line: its directory and stdout lines."""
    out = tmp_path_factory.mktemp("finished") / "runs"
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        assert main([CONFIG, *SMALL, "run.total_steps=3", "run.log_samples_every=2", "run.log_samples=3",
                     f"run.output_dir={out}"]) == 0
    (run_dir,) = out.iterdir()
    return run_dir, stdout.getvalue().splitlines()


def test_a_finished_default_run_names_its_directory_first_and_exports_a_model_transformers_loads(
        finished, tmp_path, capsys):
    run_dir, lines = finished
    assert json.loads(lines[0]) == {"run_dir": str(run_dir)}  # printed at the start, before the summary
    summary = json.loads(lines[-1])["summary"]
    assert summary["steps"] == 3 and summary["checkpoint"] == str(run_dir / "checkpoints" / "step-000003")
    assert export.main([str(run_dir), str(tmp_path / "model")]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), local_files_only=True,
                                                              dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_samples_jsonl_holds_completions_with_their_rewards_every_n_steps(finished):
    run_dir, _ = finished
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 1, 1, 2, 2, 2]  # step 1, then every 2nd; 3 each
    for row in rows:
        assert row["prompt"].startswith("<bos>R") and isinstance(row["completion"], str)
        assert 0.0 <= row["reward"] <= 1.0 and row["finish_reason"] in ("stop", "length")
        assert row["num_tokens"] <= 8


def test_evaluate_scores_an_export_and_a_run_directory_in_one_json_line(finished, tmp_path, capsys):
    run_dir, _ = finished
    assert export.main([str(run_dir), str(tmp_path / "model")]) == 0
    capsys.readouterr()
    assert evaluate.main([str(tmp_path / "model"), "policy.eval_prompts=4"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    scored = json.loads(line)
    assert scored["num_prompts"] == 4 and 0.0 <= scored["reward"] <= 1.0 and scored["task"] == "reverse_digits"
    assert evaluate.main([str(run_dir), "policy.eval_prompts=4"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["reward"] == scored["reward"] and json.loads(line)["step"] == 3  # the same weights
    assert evaluate.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: '{tmp_path / 'nope'}' is not a directory (a run directory or a " \
                                      "model directory)\n"


def test_a_run_with_save_final_off_or_whose_training_failed_writes_no_final_checkpoint(tmp_path):
    run = launch(CONFIG, *SMALL, "run.save_final=false", f"run.output_dir={tmp_path / 'off'}")
    with run:
        run.train(1)
    assert not (run.dir / "checkpoints").exists()
    run = launch(CONFIG, *SMALL, f"run.output_dir={tmp_path / 'failed'}")
    with run:
        run.train(1)

        async def broken(num_steps):
            raise RuntimeError("step failed (test)")

        run.policy.train = broken
        with pytest.raises(RuntimeError, match="step failed"):
            run.train(1)
    assert not (run.dir / "checkpoints").exists()
