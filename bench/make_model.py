"""Build a random-weight Qwen2 model directory offline, for benchmarks.

    python -m bench.make_model --out /tmp/qwen2.5-0.5b-shape                 # 358M params, bf16, ~0.7 GB
    python -m bench.make_model --out /tmp/tiny --shape tiny --dtype float32  # a few hundred k params
    python -m bench.make_model --out /tmp/q05-smol --tokenizer models/smollm2-tokenizer   # 402M, text tasks
    python -m bench.make_model --export-tokenizer models/smollm2-135m-instruct --out models/smollm2-tokenizer

Writes a Hugging Face ``Qwen2ForCausalLM`` directory (``config.json``,
``model.safetensors``, and a tokenizer's files) whose transformer body has the
shape named by ``--shape``. Its vocabulary is the built-in one-token-per-symbol
tokenizer's by default, so the built-in tasks (``reverse_digits``,
``long_tail_copy``) run on it unchanged: ``model.path=DIR``. With
``--tokenizer DIR`` it is that tokenizer's instead (its files are copied; the
vocabulary is ``len(tokenizer)`` rounded up to a multiple of 64; bos/eos/pad
ids are the tokenizer's), so text tasks (``text_arithmetic``) run on it; with
SmolLM2's 49152-token vocabulary and the Qwen2.5-0.5B body that is 402M
parameters. ``--export-tokenizer SRC --out DST`` writes only the tokenizer
files of the model directory SRC into DST (a few MB: small enough to carry to
a machine that cannot receive a checkpoint). Nothing is downloaded. The
weights are random (seeded), so the model is realistic in cost, not in
behaviour: it samples nearly uniformly and seldom stops early (warm it up
with ``tools.sft_text`` before measuring learning).

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

#: Transformer-body shapes; the vocabulary comes from the tokenizer (built-in by default).
SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B's body (its 151936-token embedding replaced by the built-in vocab)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768),
    # small enough for a CPU test; keeps head_dim 64 and GQA like the real one
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: The files of a tokenizer (and its special-token ids and chat template), copied
#: verbatim when present; a directory holds some of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")
#: The embedding of a foreign tokenizer is padded to a multiple of this many rows.
VOCAB_MULTIPLE = 64


def build_config(shape: str, dtype: str, tokenizer_dir: str | pathlib.Path | None = None) -> transformers.Qwen2Config:
    """The Qwen2 config of ``shape`` over the vocabulary of the tokenizer in
    ``tokenizer_dir`` (rounded up to a multiple of 64), or over the built-in
    tokenizer's (exactly its size) when None."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is unknown (known: {', '.join(SHAPES)})")
    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR if tokenizer_dir is None else tokenizer_dir)
    vocab_size = len(tokenizer)
    if tokenizer_dir is not None:
        vocab_size = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    body = SHAPES[shape]
    return transformers.Qwen2Config(
        **body,
        vocab_size=vocab_size,
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
        # a tokenizer without a pad token pads with eos (as generation does)
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
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


def _out_dir(out: str | pathlib.Path) -> pathlib.Path:
    out = pathlib.Path(out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def copy_tokenizer(src: str | pathlib.Path, out: str | pathlib.Path) -> list[str]:
    """Copy the tokenizer files (:data:`TOKENIZER_FILES`) that the directory
    ``src`` has into ``out``; returns their names. Raises ``ValueError`` naming
    ``src`` when it has no loadable tokenizer."""
    src = pathlib.Path(src).expanduser().resolve()
    load_tokenizer(src)  # names src when it is not a tokenizer directory
    out = _out_dir(out)
    names = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if src != out:
        for name in names:
            shutil.copyfile(src / name, out / name)
    return names


def export_tokenizer(src: str | pathlib.Path, out: str | pathlib.Path) -> dict:
    """Write only the tokenizer files of the model directory ``src`` into ``out``
    (no weights); returns what ``main`` prints."""
    names = copy_tokenizer(src, out)
    out = pathlib.Path(out).expanduser().resolve()
    tokenizer = load_tokenizer(out)  # the copy loads on its own
    return {"path": str(out), "source": str(pathlib.Path(src).expanduser().resolve()), "files": names,
            "vocab_size": len(tokenizer), "bytes_written": sum((out / n).stat().st_size for n in names)}


def make_model(out: str | pathlib.Path, *, shape: str = "qwen2.5-0.5b", dtype: str = "bfloat16",
               seed: int = 0, tokenizer: str | pathlib.Path | None = None) -> dict:
    """Write the model directory ``out`` (over the tokenizer in the directory
    ``tokenizer``, or the built-in one); returns what ``main`` prints."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown (known: {', '.join(_DTYPES)})")
    t0 = time.perf_counter()
    out = _out_dir(out)
    cfg = build_config(shape, dtype, tokenizer)
    weights = random_weights(cfg, _DTYPES[dtype], seed)
    num_params = sum(t.numel() for t in weights.values())
    # write under a temporary name so a cut-short run never leaves a loadable half file
    partial = out / "model.safetensors.partial"
    safetensors.torch.save_file(weights, str(partial), metadata={"format": "pt"})
    partial.chmod(0o644)  # safetensors creates it owner-only; the other files are world-readable
    partial.replace(out / "model.safetensors")
    del weights
    cfg.save_pretrained(out)
    copied = copy_tokenizer(BUILTIN_MODEL_DIR if tokenizer is None else tokenizer, out)
    if "generation_config.json" not in copied:  # the engine and the task read eos from it
        transformers.GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                      pad_token_id=cfg.pad_token_id).save_pretrained(out)
        copied.append("generation_config.json")
    written = ["config.json", "model.safetensors", *copied]
    return {
        "path": str(out), "shape": shape, "dtype": dtype, "seed": seed,
        "tokenizer": "built-in" if tokenizer is None else str(pathlib.Path(tokenizer).expanduser().resolve()),
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
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="take the tokenizer (and vocabulary size, bos/eos/pad ids) from this directory "
                        "instead of the built-in one")
    p.add_argument("--export-tokenizer", default=None, metavar="SRC",
                   help="write only the tokenizer files of the model directory SRC into --out; no model")
    args = p.parse_args(argv)
    if args.export_tokenizer is not None:
        if args.tokenizer is not None:
            p.error("--export-tokenizer writes no model: it takes no --tokenizer")
        print(json.dumps(export_tokenizer(args.export_tokenizer, args.out)))
        return 0
    print(json.dumps(make_model(args.out, shape=args.shape, dtype=args.dtype, seed=args.seed,
                                tokenizer=args.tokenizer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
