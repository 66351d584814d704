"""Runs inside vLLM's worker processes (``worker_extension_cls``): the calls the
vLLM engine adapter (:mod:`actors.engines.vllm_engine`) makes through
``collective_rpc``. Imports nothing of vLLM: the worker is ``self``."""

from __future__ import annotations

import torch


class WeightLoader:
    """Mixed into vLLM's worker class by name."""

    def asyncrl_load_weights(self, named: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load a whole set of Hugging Face-named tensors, sent as ``(name,
        dtype, shape, raw bytes)`` (vLLM's RPC encoding does not rebuild tensors
        nested in arguments), through vLLM's in-place reload: it puts each layer
        back in checkpoint format, maps the names onto its fused parameters
        (q/k/v, gate/up; a tied ``lm_head.weight`` is skipped) and processes the
        layer again (the CPU backend prepacks its matmul weights, so a plain
        ``load_weights`` has nothing left to write into). Returns how many came."""
        tensors = [(name, torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(shape))
                   for name, dtype, shape, data in named]
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)
