"""EngineConfig: the ``rollout.engine`` section, the one set of engine defaults.

:func:`actors.engines.make_engine` builds the engine its ``type`` names
(:mod:`actors.engines.registry`) from it; the built-in
:class:`~actors.engines.torch_engine.TorchEngine` takes its keyword defaults
from it too.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = ["CPU_MAX_NUM_SEQS", "CUDA_MAX_NUM_SEQS", "EngineConfig", "check_speculative"]

PosInt = Annotated[int, Meta(ge=1)]
#: ``max_num_seqs: null``: the sequences batched on a CPU, and on CUDA by vLLM / SGLang (which
#: fit their KV cache within it themselves) and at most by the built-in engine (which sizes it).
CPU_MAX_NUM_SEQS = 128
CUDA_MAX_NUM_SEQS = 256


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One rollout engine: which one, where it runs, and how much it batches."""

    type: str = "torch"
    """Rollout engine: a registered name or the import path ``package.module:attr`` of an
    engine's factory (``docs/engines.md``, "Adding an engine"). ``torch`` is built in;
    ``vllm`` when vLLM is installed; ``sglang`` talks to an SGLang server over HTTP
    (``url``, or one it launches where SGLang is installed)."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:i]``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and compute dtype of the engine. ``auto`` (resolved when the config is
    read, so the run's saved config holds the dtype chosen): ``bfloat16`` when ``device``
    is ``cuda[:i]``, ``float32`` elsewhere."""
    weight_dtype: Literal["auto", "fp8"] = "auto"
    """Built-in engine on CUDA (Hopper), ``dtype: bfloat16``: ``fp8`` keeps every layer's linears
    as ``float8_e4m3fn`` with one scale per 128x128 block and runs them as FP8 GEMMs; the
    embedding, norms and head stay in ``dtype``, and a bf16 master copy stays for the pushes,
    each of which re-quantizes what it changed (``docs/fp8.md``). The rollout's log-probs are
    the FP8 model's own: train with ``trainer.loss: decoupled_ppo``, which corrects for them (with
    ``ppo_clip`` FP8 rollout collapsed on SmolLM2-135M). ``auto``: every weight in ``dtype``."""
    fp8_skip: list[str] = []
    """With ``weight_dtype: fp8``: the linears that stay in ``dtype``, as substrings of their
    Hugging Face names (``q_proj``: every layer's fused q/k/v; ``layers.0.``: all of layer 0's),
    as vLLM's ``ignored_layers``; a pattern that matches no linear is an error at setup."""
    max_num_seqs: PosInt | None = None
    """Concurrent sequences the engine batches (its KV cache holds this many of
    ``max_model_len`` tokens). ``null`` (auto): the built-in engine on CUDA sizes it at
    setup, the most sequences (up to 256) whose KV cache fits in half the device memory
    free then (logged; ``max_num_seqs`` in its statistics); 256 for vLLM and SGLang on
    CUDA, 128 on a CPU (resolved when the config is read)."""
    max_model_len: PosInt = 128
    """Prompt + response tokens per sequence (KV cache slot length)."""
    cuda_graphs: bool = True
    """Built-in engine on CUDA: replay decode steps as CUDA graphs."""
    compile_decode: bool = False
    """Built-in engine on CUDA, decode batches over 64 rows: fuse their elementwise work
    with torch.compile (compiles once per batch-size bucket: pays off in long runs).
    Batches of up to 64 rows run the fused Triton decode layers where those apply
    (Triton installed; Llama / Qwen2, not Qwen3's q/k norms)."""
    speculative: Literal["off", "mtp"] = "off"
    """Built-in engine only: ``mtp`` drafts ``model.mtp_layers`` (K) tokens a decode step with
    the model's MTP modules and verifies them with the full model in one forward, by exact
    speculative sampling: tokens and log-probs are the full model's, and a request advances
    by 1 to K + 1 tokens a step (``docs/mtp.md``, "Speculative decoding"). It costs K module
    forwards and a (K + 1)-token verify per step, the modules' KV cache (one layer each) and
    eager steps (no CUDA graphs, no overlap). It pays where decode is bound by reading the
    weights (small batches, long responses) and the drafts are often accepted; not with
    untrained modules or compute-bound batches. Needs ``model.mtp_layers`` > 0."""
    url: str | None = None
    """``sglang`` only: base URL of a running SGLang server (``http://host:port``) serving
    the run's model; the adapter then needs no SGLang package, only HTTP. Weight updates
    go as files the server must read at the same path: a server on this host (or one that
    shares its temporary directory). null: launch ``python -m sglang.launch_server`` on a
    free loopback port (needs SGLang installed)."""

    def __post_init__(self) -> None:
        self._resolve_auto()
        self._check_weight_dtype()
        if self.speculative != "off" and self.type != "torch":
            raise ValueError(f"speculative must be 'off' unless type is 'torch' (type is {self.type!r})")
        if self.url is None:
            return
        if self.type != "sglang":
            raise ValueError(f"url must be null unless type is 'sglang' (type is {self.type!r})")
        u = urllib.parse.urlsplit(self.url)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme != "http" or not u.hostname or port is None or u.path not in ("", "/") or u.query:
            raise ValueError(f"url must be http://host:port (an SGLang server), got {self.url!r}")

    def _check_weight_dtype(self) -> None:
        if self.weight_dtype != "fp8":
            if self.fp8_skip:
                raise ValueError(f"fp8_skip {self.fp8_skip} needs weight_dtype 'fp8' (it is {self.weight_dtype!r})")
            return
        if self.type != "torch":
            raise ValueError(f"weight_dtype 'fp8' is the built-in engine's (type: torch), not type {self.type!r}'s")
        if not self.device.startswith("cuda"):
            raise ValueError(f"weight_dtype 'fp8' needs device cuda[:i] (FP8 GEMMs), got device {self.device!r}")
        if self.dtype != "bfloat16":
            raise ValueError(f"weight_dtype 'fp8' needs dtype bfloat16, got dtype {self.dtype!r}")

    def _resolve_auto(self) -> None:
        """Replace ``auto`` / ``null`` once, when the section is built, so that every reader
        and the run's saved config see a concrete value; a value given is kept. Only the
        built-in engine on CUDA keeps ``max_num_seqs`` null: it alone sizes its KV cache
        from the memory free at setup (``actors/engines/engine_core.py``)."""
        cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if cuda else "float32"
        if self.max_num_seqs is None and not (cuda and self.type == "torch"):
            self.max_num_seqs = CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS



def check_speculative(speculative: str, mtp_layers: int) -> None:
    """``speculative`` (``rollout.engine.speculative``) against ``mtp_layers``
    (``model.mtp_layers``): a one-line ``ValueError`` where they do not go together."""
    if speculative not in ("off", "mtp"):
        raise ValueError(f"speculative={speculative!r} is not one of 'off', 'mtp'")
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers={mtp_layers} must be >= 0")
    if speculative == "mtp" and mtp_layers == 0:
        raise ValueError("speculative='mtp' drafts with the MTP modules: it needs model.mtp_layers > 0")
