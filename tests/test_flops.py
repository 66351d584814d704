"""Model FLOPs and MFU (actors.backends.flops), counted by hand."""

from __future__ import annotations

import pytest
import transformers

from actors.backends.flops import FlopsModel, peak_flops


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_are_all_but_the_input_embedding_and_the_head_counts_even_when_tied(tmp_path, tied):
    d, f, v, layers, heads, kv, hd = 32, 48, 50, 3, 4, 2, 8
    config = transformers.LlamaConfig(hidden_size=d, intermediate_size=f, vocab_size=v, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                                      tie_word_embeddings=tied)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f + 2 * d  # q, k, v, o, mlp, 2 norms
    expected = layers * per_layer + d + v * d  # + final norm + the head
    fm = FlopsModel.from_model_dir(tmp_path)
    assert (fm.matmul_params, fm.num_layers, fm.attn_width) == (expected, layers, heads * hd)
    assert fm.train_flops([5, 7]) == 6 * expected * 12 + 6 * layers * heads * hd * (25 + 49)
    mtp = FlopsModel.from_model_dir(tmp_path, mtp_layers=2)  # each: a layer, eh_proj, 3 norms; the head on responses
    module = per_layer + 2 * d * d + 3 * d
    assert mtp.train_flops([5, 7], [2, 3]) == (6 * (expected + 2 * module) * 12
                                              + 6 * (layers + 2) * heads * hd * (25 + 49) + 6 * 2 * v * d * 5)


def test_no_peak_on_a_cpu():
    assert peak_flops("cpu", "float32") is None
