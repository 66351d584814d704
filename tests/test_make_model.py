import json

import pytest
import torch
import transformers

from actors.engines.model import ModelConfig
from actors.engines.weights import WeightStore
from actors.models import BUILTIN_MODEL_DIR, load_causal_lm, load_tokenizer
from bench.make_model import SHAPES, build_config, main, make_model
from policies.tasks import make_task

pytestmark = pytest.mark.timeout(120)


def test_tiny_shape_loads_through_the_project_loader_with_the_builtin_vocab(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--shape", "tiny", "--dtype", "float32", "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = load_causal_lm(tmp_path)
    cfg = model.config
    num_params = sum(p.numel() for p in model.parameters())
    assert report["path"] == str(tmp_path.resolve()) and report["num_params"] == num_params < 2_000_000
    assert report["bytes_written"] >= 4 * num_params
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size) == ("qwen2", 128, 384)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 2, 1, 64)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.max_position_embeddings >= 32768
    tok = load_tokenizer(tmp_path)
    builtin = load_tokenizer(BUILTIN_MODEL_DIR)
    assert cfg.vocab_size == len(tok) == len(builtin) and tok.get_vocab() == builtin.get_vocab()
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    # the built-in tasks accept the copied tokenizer, and the model scores their prompts
    for name in ("reverse_digits", "long_tail_copy"):
        make_task(name, tokenizer=tok)
    logits = model(input_ids=torch.tensor([tok("R123:")["input_ids"]])).logits
    assert logits.shape == (1, 5, cfg.vocab_size) and torch.isfinite(logits).all()


def test_weights_are_written_in_the_requested_dtype_and_the_engine_reads_them(tmp_path):
    make_model(tmp_path, shape="tiny", dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf.dtype == torch.bfloat16
    store = WeightStore(ModelConfig.from_dir(tmp_path), torch.device("cpu"), torch.bfloat16)
    store.load_dir(tmp_path)
    state = hf.state_dict()
    assert all(torch.equal(store.params[name], state[name]) for name in store.params)
    # initialised like HF: norm scales 1, biases 0, the padding row of the embedding 0
    assert torch.all(state["model.norm.weight"] == 1) and torch.all(state["model.layers.0.self_attn.q_proj.bias"] == 0)
    assert torch.all(state["model.embed_tokens.weight"][hf.config.pad_token_id] == 0)


def test_same_seed_gives_the_same_weights_and_another_seed_does_not(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_model(tmp_path / name, shape="tiny", dtype="float32", seed=seed)
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]


def test_qwen2_5_0_5b_shape_has_about_358m_params_over_the_builtin_vocab():
    cfg = build_config("qwen2.5-0.5b", "bfloat16")
    with torch.device("meta"):  # counts without allocating 0.7 GB
        model = transformers.Qwen2ForCausalLM(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    assert 350_000_000 <= num_params <= 360_000_000
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (896, 4864, 24)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (14, 2, True)
    assert cfg.vocab_size == len(load_tokenizer(BUILTIN_MODEL_DIR))


def test_unknown_shape_or_dtype_is_a_value_error_naming_it(tmp_path):
    assert set(SHAPES) == {"qwen2.5-0.5b", "tiny"}
    with pytest.raises(ValueError, match="shape='huge'"):
        make_model(tmp_path, shape="huge")
    with pytest.raises(ValueError, match="dtype='float16'"):
        make_model(tmp_path, shape="tiny", dtype="float16")
