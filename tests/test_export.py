"""Export (issue 22 item 3): a run trained two steps is written as a Hugging Face
model directory, from the live run (``run.export_hf``) and from its checkpoint
(``python -m actors.export``); ``transformers`` loads it and its log-probs match
the trainer's within fp32 tolerance; a run starts from it as ``model.path``;
bad input is one line and exit 2. Both the built-in tiny Qwen2 and a tiny Llama
(untied head, no tokenizer files or generation config of its own) are exported."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers

from actors import export
from actors.launch import launch
from actors.models import BUILTIN_MODEL_DIR
from contracts.sample import Sample

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["trainer.batch_prompts=2", "rollout.n=4", "rollout.max_response_tokens=8", "run.progress=false"]
# The exported model and the trainer run the same fp32 weights through the same
# Hugging Face modeling code; only the batching differs (the trainer pads rows to
# the longest and runs them as one batch, here one unpadded row at a time), which
# changes float summation order: per-token log-probs agree to ~1e-6.
LOGPROB_ATOL = 1e-5

pytestmark = pytest.mark.timeout(240)


def _tiny_llama(path: pathlib.Path) -> pathlib.Path:
    """A random LlamaForCausalLM over the built-in vocabulary: weights and config only
    (the symbol task builds its own tokenizer; no generation_config.json)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(BUILTIN_MODEL_DIR), local_files_only=True)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def _sequences(vocab_size: int) -> list[Sample]:
    """Prompts and responses of different lengths over the whole vocabulary."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate([(3, 5), (7, 2), (5, 9), (1, 4)]):
        ids = torch.randint(3, vocab_size, (p + r,), generator=g).tolist()
        out.append(Sample(uid=f"s{i}", group_id="g", prompt_ids=[1, *ids[:p]], response_ids=ids[p:]))
    return out


@torch.no_grad()
def _hf_logprobs(model: transformers.PreTrainedModel, samples: list[Sample]) -> list[list[float]]:
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logprobs = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float().log_softmax(-1)
        out.append(logprobs.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_an_exported_run_loads_in_transformers_with_the_trainers_logprobs_and_starts_a_run(arch, tmp_path):
    model_path = BUILTIN_MODEL_DIR if arch == "qwen2" else _tiny_llama(tmp_path / "tiny-llama")
    run = launch(ROOT / "fully_async.yaml", *SMALL, f"model.path={model_path}", "run.checkpoint_every=2",
                 f"run.output_dir={tmp_path / 'runs'}")
    try:
        run.train(2)
        live = run.export_hf(tmp_path / "live")
        backend = run.policy.trainer.actor.backend  # the local runtime's trainer, in this process
        samples = _sequences(backend.model.config.vocab_size)
        expected = backend.compute_logprobs(samples)
        trained = {k: v.detach().clone() for k, v in backend.named_weights().items()}
    finally:
        run.close()
    assert export.main([str(run.dir), str(tmp_path / "cli")]) == 0  # its newest checkpoint: step 2 as well
    for out in (live, tmp_path / "cli"):
        names = {p.name for p in out.iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
        assert not names & {"optimizer.pt", "trainer_state.json", "rng-rank0.pt"}
        assert json.loads((out / "export.json").read_text())["step"] == 2
        on_disk = safetensors.torch.load_file(str(out / "model.safetensors"))
        base = safetensors.torch.load_file(str(model_path / "model.safetensors"))
        assert any(not torch.equal(t, base[name]) for name, t in on_disk.items())  # two steps moved the weights
        for name, tensor in on_disk.items():  # bit for bit (a tied lm_head is stored once, as HF does)
            assert torch.equal(tensor, trained[name]), name
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
        assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
        got = _hf_logprobs(model.eval(), samples)
        for want_row, got_row in zip(expected, got):
            assert got_row == pytest.approx(want_row, abs=LOGPROB_ATOL, rel=0)
        tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(
            str(BUILTIN_MODEL_DIR), local_files_only=True).get_vocab()
        assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == tok.eos_token_id

    # the export is a model.path: the built-in engine serves it and the trainer trains it
    again = launch(ROOT / "fully_async.yaml", *SMALL, f"model.path={live}", f"run.output_dir={tmp_path / 'again'}")
    try:
        (record,) = again.train(1)
    finally:
        again.close()
    assert record["step"] == 1 and record["sync/kind"] == "full" and 0.0 <= record["reward"] <= 1.0


def test_export_casts_to_a_dtype_on_request(tmp_path):
    run = launch(ROOT / "fully_async.yaml", *SMALL, f"run.output_dir={tmp_path / 'runs'}")
    try:
        run.train(1)
        out = run.export_hf(tmp_path / "bf16", dtype="bfloat16")
    finally:
        run.close()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in safetensors.torch.load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.dtype == torch.bfloat16


def test_export_of_a_missing_run_or_checkpoint_or_into_a_full_directory_is_one_line_and_exit_2(tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "actors.export", str(tmp_path / "nope"), str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: '{tmp_path / 'nope'}': no such run directory\n"

    (tmp_path / "empty-run").mkdir()
    assert export.main([str(tmp_path / "empty-run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: '{tmp_path / 'empty-run'}': no checkpoint in ") and err.count("\n") == 1
    assert "run.export_hf" in err and not (tmp_path / "out").exists()

    # a run directory with a checkpoint (a copy of one: only its files matter), into a directory in use
    run = launch(ROOT / "fully_async.yaml", *SMALL, f"run.output_dir={tmp_path / 'runs'}")
    try:
        run.train(1)
        run.save_checkpoint()
    finally:
        run.close()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert export.main([str(run.dir), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: export directory '{tmp_path / 'full'}' exists and is not empty\n"
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert export.main([str(run.dir), str(tmp_path / "full" / "sub")]) == 0  # a new directory is fine
    shutil.rmtree(tmp_path / "full")
