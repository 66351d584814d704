"""A slot-based KV cache, allocated once.

One slot per running request holds its keys and values for every position up
to ``max_len``: ``k[layer]`` / ``v[layer]`` are [num_slots, Hkv, max_len, D].
Memory is fixed at allocation and never grows with steps. Running requests
are kept packed into slots ``0..n-1`` (see :meth:`move`), so a decode step of
``n`` requests reads the contiguous prefix ``k[layer][:n]``.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype):
        self.shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return 2 * self.num_layers * n * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        if not self.allocated:
            # zeros, not empty: unused rows of a padded decode batch must read finite values
            self.k = [torch.zeros(self.shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
            self.v = [torch.zeros(self.shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]

    def free(self) -> None:
        """Drop the tensors (``sleep``): their memory goes back to the allocator."""
        self.k, self.v = [], []

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for layer in range(self.num_layers):
            self.k[layer][dst, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][dst, :, :length] = self.v[layer][src, :, :length]
