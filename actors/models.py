"""Find and load Hugging Face causal-LM directories from local disk only.

Nothing here ever reaches a model hub: every loader passes
``local_files_only=True`` and paths are checked before transformers sees them,
so a typo gives one clear ``ValueError`` instead of a download attempt or a
long traceback.
"""

from __future__ import annotations

import pathlib
import threading

import torch
import transformers

from actors.engines.model import prefer_shape_agnostic_attention

# Any of these next to config.json counts as weights.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

#: ``from_pretrained`` is not thread-safe (transformers 5): two loads at once in one process
#: (the local runtime's trainer thread and a transformers-based engine) leave meta tensors.
_FROM_PRETRAINED = threading.Lock()

#: The built-in tiny Qwen2 model and tokenizer (built by ``tools.warmstart``).
BUILTIN_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "tiny-qwen2"


def resolve_model_path(path: str | pathlib.Path, base_dir: str | pathlib.Path | None = None) -> pathlib.Path:
    """Return the absolute directory of a local HF causal-LM checkpoint.

    A relative ``path`` is tried against ``base_dir`` (the directory of the
    config file that named it) first, then against the current directory.
    Raises ``ValueError`` naming the path when no candidate exists, or when the
    directory lacks ``config.json`` or a weights file.
    """
    raw = pathlib.Path(path).expanduser()
    if raw.is_absolute():
        candidates = [raw]
    else:
        candidates = ([pathlib.Path(base_dir) / raw] if base_dir is not None else []) + [pathlib.Path.cwd() / raw]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        tried = ", ".join(str(c) for c in candidates)
        raise ValueError(f"model path {str(path)!r} is not a directory (tried: {tried})")
    found = found.resolve()
    missing = []
    if not (found / "config.json").is_file():
        missing.append("config.json")
    if not any((found / name).is_file() for name in _WEIGHT_FILES):
        missing.append("weights (" + " or ".join(_WEIGHT_FILES[::2]) + ")")
    if missing:
        raise ValueError(f"model path {str(found)!r} has no {' and no '.join(missing)}")
    return found


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def check_model_files(model_dir: str | pathlib.Path) -> None:
    """Refuse a model directory whose files are corrupt before anything loads them,
    with a ``ValueError`` naming the file: ``config.json`` that transformers cannot
    read as a config, safetensors files whose header is not one (garbage, truncated,
    a Git LFS pointer), a ``tokenizer.json`` or ``tokenizer_config.json`` that does
    not parse (a task with a tokenizer of its own never reads them; an export copies
    them). Reads headers only: milliseconds, a large tokenizer.json a few tenths of a second."""
    import json

    import safetensors
    import tokenizers

    d = pathlib.Path(model_dir)
    try:
        transformers.AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, the file is what is wrong
        raise ValueError(f"model file {str(d / 'config.json')!r} is not a model config ({_one_line(err)})") from None
    files = [d / "model.safetensors"] if (d / "model.safetensors").is_file() else []
    index = d / "model.safetensors.index.json"
    if not files and index.is_file():
        try:
            files = [d / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except Exception as err:  # noqa: BLE001 - any parse failure: the index is unreadable
            raise ValueError(f"model file {str(index)!r} is not a safetensors index ({_one_line(err)})") from None
    for f in files:
        try:
            with safetensors.safe_open(str(f), framework="pt"):
                pass
        except Exception as err:  # noqa: BLE001 - missing, truncated, garbage: the file is what is wrong
            raise ValueError(f"model file {str(f)!r} is not a safetensors file ({_one_line(err)})") from None
    checks = (("tokenizer.json", lambda f: tokenizers.Tokenizer.from_file(str(f))),
              ("tokenizer_config.json", lambda f: json.loads(f.read_text())))
    for name, load in checks:
        if (d / name).is_file():
            try:
                load(d / name)
            except Exception as err:  # noqa: BLE001 - any parse failure: the file is corrupt
                raise ValueError(f"tokenizer file {str(d / name)!r} is corrupt ({_one_line(err)})") from None


def load_causal_lm(
    path: str | pathlib.Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    base_dir: str | pathlib.Path | None = None,
) -> transformers.PreTrainedModel:
    """Load a local HF causal LM (Llama, Qwen2, Qwen3, ...) onto ``device`` in ``dtype``.

    Uses eager attention on CPU so results do not depend on which fused
    kernels a machine happens to have.
    """
    model_dir = resolve_model_path(path, base_dir)
    prefer_shape_agnostic_attention(device)
    kwargs: dict = {"local_files_only": True, "dtype": dtype}
    if torch.device(device).type == "cpu":
        kwargs["attn_implementation"] = "eager"
    with _FROM_PRETRAINED:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    return model.to(device)


def load_tokenizer(path: str | pathlib.Path, *, base_dir: str | pathlib.Path | None = None):
    """Load the local tokenizer saved next to a model (``AutoTokenizer``, no hub).

    Raises ``ValueError`` naming the directory when it holds no tokenizer files.
    """
    raw = pathlib.Path(path).expanduser()
    candidates = [raw] if raw.is_absolute() else (
        ([pathlib.Path(base_dir) / raw] if base_dir is not None else []) + [pathlib.Path.cwd() / raw]
    )
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
    if not any((found / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"tokenizer path {str(found)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})")
    return transformers.AutoTokenizer.from_pretrained(str(found), local_files_only=True)
