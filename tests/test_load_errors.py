"""Load errors of a run's inputs (issue 46 item 5): a corrupt model file (weights,
``config.json``, ``tokenizer.json``) and chat-message data on a model without a
chat template are each one line on stderr naming the file, exit 2, and no run
directory left behind; the chat case gives one way out, not two in a circle."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from actors.cli import main
from actors.models import BUILTIN_MODEL_DIR

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "fully_async.yaml")
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false"]


def _model_copy(tmp_path: pathlib.Path, name: str, data: bytes) -> pathlib.Path:
    model = tmp_path / "model"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    (model / name).write_bytes(data)
    return model


@pytest.mark.parametrize(("name", "data", "what"), [
    ("model.safetensors", b"\xff" * 4096, "is not a safetensors file (SafetensorError: "),
    ("config.json", b'{"model_type": "qwen2", "hidden_size": "big"}', "is not a model config ("),
    ("tokenizer.json", b'{"version": "1.0", garbage', "is corrupt ("),
])
def test_a_corrupt_model_file_is_one_line_naming_the_file(name, data, what, tmp_path, capsys):
    model = _model_copy(tmp_path, name, data)
    out = tmp_path / "runs"
    rc = main([CONFIG, *SMALL, f"model.path={model}", f"run.output_dir={out}"])
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert rc == 2 and line.startswith("error: ") and f"'{model / name}' {what}" in line, err
    assert not out.exists()


def test_chat_message_data_on_a_model_without_a_chat_template_is_one_error_with_one_way_out(tmp_path, capsys):
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}) + "\n")
    out = tmp_path / "runs"
    lines = []
    for template in ("true", "false"):  # neither sends the user to the other
        rc = main([CONFIG, *SMALL, "task.type=text_dataset", f"task.kwargs.path={rows}",
                   f"task.kwargs.chat_template={template}", f"run.output_dir={out}"])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and f"{rows}:1: the prompt is chat messages, which only a chat template can render" in line
        assert "use a model whose tokenizer has a chat template (model.path), or give plain-text prompts" in line
        lines.append(line)
    assert "set task.kwargs.chat_template=false" not in lines[0].replace("(a string per row) with task.kwargs."
                                                                         "chat_template=false", "")
