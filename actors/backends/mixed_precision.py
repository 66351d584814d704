"""Megatron-style mixed precision for the torch backend: fp32 main params in
the optimizer, model params in the compute dtype (bf16).

    forward/backward on the bf16 model params ─► grads (bf16)
        ─► main grads (fp32) ─► clip ─► optimizer step on the fp32 main params
        ─► model params = main params rounded to bf16 (the step's last write)

Stepping bf16 params directly loses every update smaller than half a bf16
ulp, which at RL learning rates is nearly all of them; the fp32 main params
accumulate them until they move the rounded value. The model params are the
weights the engines run, so a weight sync reads them as they are (no cast).

The grad cast and the write-back are multi-tensor copies (``torch._foreach_copy_``,
a few kernels for all params instead of one launch per param); the main grads
live in one flat buffer per step, filled a bucket of params at a time so the
model grads are freed as they go (the step's grad memory stays about what a
per-param cast held).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


#: Params per multi-tensor grad cast: the model grads of a bucket are freed before the next
#: is cast, so at most ~1/_NUM_CAST_BUCKETS of them sit beside the full fp32 main grads.
_NUM_CAST_BUCKETS = 4


class MainParamsOptimizer:
    """Wraps an optimizer built over fp32 copies of ``params``.

    ``make_optimizer(main_params)`` builds the inner optimizer. Use
    :meth:`zero_grad`, :meth:`clip_and_step` and :attr:`param_groups` as with
    a plain optimizer; :meth:`state_dict` holds the main params too, so a
    checkpoint resumes them exactly.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 main_dtype: torch.dtype = torch.float32) -> None:
        self.params = list(params)
        self.main = [p.detach().to(main_dtype).clone().requires_grad_(True) for p in self.params]
        self.optimizer = make_optimizer(self.main)

    @property
    def param_groups(self) -> list[dict[str, object]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Move the model grads to the main params, clip their global norm,
        step, and write the main params back into the model params. Returns
        the norm before clipping (a 0-d device tensor, unread)."""
        self._cast_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.main, max_norm)
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.main)  # round to the model dtype, as copy_ does
        return norm

    def _cast_grads(self) -> None:
        """``main.grad`` = ``param.grad`` in the main dtype (None where the param has none:
        the step skips it), views of one flat buffer per device; the model grads freed."""
        for m in self.main:
            m.grad = None
        by_device: dict[torch.device, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        for p, m in zip(self.params, self.main):
            if p.grad is not None:
                by_device.setdefault(m.device, []).append((p, m))
        for device, pairs in by_device.items():
            main = [m for _, m in pairs]
            flat = torch.empty(sum(m.numel() for m in main), dtype=main[0].dtype, device=device)
            grads = torch._utils._unflatten_dense_tensors(flat, main)  # views shaped as the main params
            step = -(-len(pairs) // _NUM_CAST_BUCKETS)
            for start in range(0, len(pairs), step):
                bucket = pairs[start : start + step]
                torch._foreach_copy_(grads[start : start + step], [p.grad for p, _ in bucket])
                for p, _ in bucket:
                    p.grad = None
            for m, g in zip(main, grads):
                m.grad = g

    def state_dict(self) -> dict[str, object]:
        return {"optimizer": self.optimizer.state_dict(), "main_params": [m.detach() for m in self.main]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, object]) -> None:
        if set(state) != {"optimizer", "main_params"} or len(state["main_params"]) != len(self.main):
            raise ValueError("optimizer state is not a mixed-precision checkpoint of this model")
        for p, m, saved in zip(self.params, self.main, state["main_params"]):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
