import pytest
import torch
import transformers

from actors.models import BUILTIN_MODEL_DIR, load_causal_lm, load_tokenizer, resolve_model_path


def _save_tiny(config: transformers.PretrainedConfig, directory) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def test_relative_path_resolves_against_the_config_directory_first(tmp_path, monkeypatch):
    (tmp_path / "cfg" / "ckpt").mkdir(parents=True)
    (tmp_path / "cfg" / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "cfg" / "ckpt" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("ckpt", base_dir=tmp_path / "cfg") == (tmp_path / "cfg" / "ckpt").resolve()
    # Falls back to the current directory when base_dir does not have it.
    assert resolve_model_path("cfg/ckpt", base_dir=tmp_path / "elsewhere") == (tmp_path / "cfg" / "ckpt").resolve()


def test_missing_directory_config_or_weights_is_named_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="not a directory") as e:
        resolve_model_path(tmp_path / "nope")
    assert "nope" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="weights"):
        resolve_model_path(tmp_path)


def test_builtin_model_and_tokenizer_load_and_agree_on_eos():
    model = load_causal_lm(BUILTIN_MODEL_DIR)
    tok = load_tokenizer(BUILTIN_MODEL_DIR)
    assert model.config.model_type == "qwen2" and model.config.head_dim == 64
    assert model.dtype == torch.float32
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert tok.decode(tok("R123:")["input_ids"]) == "R123:"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_any_hf_causal_lm_directory_loads(tmp_path, kind):
    common = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    config = transformers.AutoConfig.for_model(kind, **common)
    _save_tiny(config, tmp_path)
    model = load_causal_lm(tmp_path)
    assert model.config.model_type == kind
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 32)


def test_directory_without_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path)
