"""Megatron-style mixed precision for the torch backend: fp32 main params in
the optimizer, model params in the compute dtype (bf16).

    forward/backward on the bf16 model params ─► grads (bf16)
        ─► main grads (fp32) ─► clip ─► optimizer step on the fp32 main params
        ─► model params = main params rounded to bf16 (the step's last write)

Stepping bf16 params directly loses every update smaller than half a bf16
ulp, which at RL learning rates is nearly all of them; the fp32 main params
accumulate them until they move the rounded value. The model params are the
weights the engines run, so a weight sync reads them as they are (no cast).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


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
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float) -> torch.Tensor:
        """Move the model grads to the main params, clip their global norm,
        step, and write the main params back into the model params. Returns
        the norm before clipping."""
        for p, m in zip(self.params, self.main):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.main, max_norm)
        self.optimizer.step()
        for p, m in zip(self.params, self.main):
            p.copy_(m)  # round to the model dtype, as torch casts
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "main_params": [m.detach() for m in self.main]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"optimizer", "main_params"} or len(state["main_params"]) != len(self.main):
            raise ValueError("optimizer state is not a mixed-precision checkpoint of this model")
        for p, m, saved in zip(self.params, self.main, state["main_params"]):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
