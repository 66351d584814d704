"""Build a random-weight Qwen2 model directory offline, for benchmarks.

    python -m bench.make_model --out /tmp/qwen2.5-0.5b-shape                 # 358M params, bf16, ~0.7 GB
    python -m bench.make_model --out /tmp/tiny --shape tiny --dtype float32  # a few hundred k params

Writes a Hugging Face ``Qwen2ForCausalLM`` directory (``config.json``,
``model.safetensors``, and the built-in tokenizer's files) whose transformer
body has the shape named by ``--shape`` but whose vocabulary is the built-in
one-token-per-symbol tokenizer's, so the built-in tasks (``reverse_digits``,
``long_tail_copy``) run on it unchanged: ``model.path=DIR``. Nothing is
downloaded. The weights are random (seeded), so the model is realistic in
cost, not in behaviour: it samples nearly uniformly and seldom stops early.

Low peak memory: the model is built on the meta device only to learn
Hugging Face's parameter names and shapes; each tensor is then allocated
directly in ``--dtype`` and filled, so the peak is about one copy of the
weights. Prints one JSON line: path, parameter count, bytes written, seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

import safetensors.torch
import torch
import transformers

from actors.models import BUILTIN_MODEL_DIR, load_tokenizer

#: Transformer-body shapes; the vocabulary always comes from the built-in tokenizer.
SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B's body (its 151936-token embedding replaced by the built-in vocab)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768),
    # small enough for a CPU test; keeps head_dim 64 and GQA like the real one
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: Copied verbatim from the built-in model: the tokenizer and its special-token ids.
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_config(shape: str, dtype: str) -> transformers.Qwen2Config:
    """The Qwen2 config of ``shape`` over the built-in tokenizer's vocabulary."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown (known: {', '.join(SHAPES)})")
    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR)
    body = SHAPES[shape]
    return transformers.Qwen2Config(
        **body,
        vocab_size=len(tokenizer),
        head_dim=body["hidden_size"] // body["num_attention_heads"],
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        max_window_layers=body["num_hidden_layers"],
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
        architectures=["Qwen2ForCausalLM"],
    )


@torch.no_grad()
def random_weights(cfg: transformers.Qwen2Config, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights initialised like ``Qwen2PreTrainedModel._init_weights``:
    matrices ~ N(0, initializer_range), biases 0, RMSNorm scales 1, the padding
    row of the embedding 0. Tied ``lm_head.weight`` is not a separate tensor."""
    with torch.device("meta"):  # names and shapes only; no memory
        meta = transformers.Qwen2ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, p in meta.named_parameters():  # tied parameters appear once
        t = torch.empty(p.shape, dtype=dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, cfg.initializer_range, generator=gen)
        weights[name] = t
    if cfg.pad_token_id is not None:
        weights["model.embed_tokens.weight"][cfg.pad_token_id].zero_()
    return weights


def make_model(out: str | pathlib.Path, *, shape: str = "qwen2.5-0.5b", dtype: str = "bfloat16",
               seed: int = 0) -> dict:
    """Write the model directory ``out``; returns what ``main`` prints."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown (known: {', '.join(_DTYPES)})")
    t0 = time.perf_counter()
    out = pathlib.Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(shape, dtype)
    weights = random_weights(cfg, _DTYPES[dtype], seed)
    num_params = sum(t.numel() for t in weights.values())
    # write under a temporary name so a cut-short run never leaves a loadable half file
    partial = out / "model.safetensors.partial"
    safetensors.torch.save_file(weights, str(partial), metadata={"format": "pt"})
    partial.chmod(0o644)  # safetensors creates it owner-only; the other files are world-readable
    partial.replace(out / "model.safetensors")
    del weights
    cfg.save_pretrained(out)
    for name in _COPIED_FILES:
        shutil.copyfile(BUILTIN_MODEL_DIR / name, out / name)
    written = ["config.json", "model.safetensors", *_COPIED_FILES]
    return {
        "path": str(out), "shape": shape, "dtype": dtype, "seed": seed,
        "num_params": num_params, "vocab_size": cfg.vocab_size,
        "bytes_written": sum((out / name).stat().st_size for name in written),
        "build_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="model directory to write (created; files in it are replaced)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(make_model(args.out, shape=args.shape, dtype=args.dtype, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
