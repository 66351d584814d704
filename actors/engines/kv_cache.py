"""Slot-indexed state of the running requests: the KV cache (on the device,
allocated once) and a table of what each request is and sampled (:class:`SlotTable`, on the host).

One slot per running request holds its keys and values for every position up
to ``max_len``: ``k[layer]`` / ``v[layer]`` are [num_slots, Hkv, max_len, D],
views of one [num_layers, num_slots, Hkv, max_len, D] tensor each (so moving a
slot is one copy for all layers). Memory is fixed at allocation and never
grows with steps. Running requests are kept packed into slots ``0..n-1`` (see
:meth:`move`), so a decode step of ``n`` requests reads the contiguous prefix
``k[layer][:n]``.
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
        self._k: torch.Tensor | None = None  # [num_layers, *shape]
        self._v: torch.Tensor | None = None
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
            shape = (self.num_layers, *self.shape)
            self._k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.k, self.v = list(self._k.unbind(0)), list(self._v.unbind(0))

    def free(self) -> None:
        """Drop the tensors (``sleep``): their memory goes back to the allocator."""
        self._k = self._v = None
        self.k, self.v = [], []

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """For each (src, dst, length): copy the first ``length`` positions of
        slot ``src`` into slot ``dst``, every layer at once."""
        for src, dst, length in moves:
            self._k[:, dst, :, :length] = self._k[:, src, :, :length]
            self._v[:, dst, :, :length] = self._v[:, src, :, :length]


def slots_that_fit(budget_bytes: int, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int,
                   dtype: torch.dtype, most: int) -> int:
    """The most slots (1 to ``most``) whose keys and values, ``max_len`` positions each,
    fit in ``budget_bytes`` (``rollout.engine.max_num_seqs: null`` on CUDA)."""
    slot_bytes = 2 * num_layers * num_kv_heads * max_len * head_dim * dtype.itemsize
    return max(1, min(most, budget_bytes // slot_bytes))


class SlotTable:
    """The running requests' state on the host, by slot, so that the per-step
    and per-change work of the engine's thread does not loop over requests:

    * ``values[:, c % ring, slot]``: (token, logprob, raw logprob) sampled at
      decode step ``c`` by the request in ``slot``; a step of slots ``0..n-1``
      writes one [3, n] block. A request admitted when ``num_steps`` was ``c``
      has its prefill token in column ``first = c - 1``, then one per step, so
      its length is ``base + num_steps - first`` (``base``: its tokens before).
      It spans at most ``max_len`` steps, so a ring of ``max_len + 1`` columns
      never overwrites its tokens.
    * ``deadline[slot]``: the request has sampled its last position (max
      tokens, max length) once ``num_steps > deadline``.
    * ``params[:, slot]``: temperature, top-k, top-p, seed (float64: exact);
      ``flags[:, slot]``: the :data:`FLAGS` a sampling batch needs to know.
    """

    FLAGS = ("greedy", "filtered", "not_unit_temperature", "seeded", "streamed")

    def __init__(self, num_slots: int, max_len: int, dtype: torch.dtype):
        self.ring = max_len + 1
        self.values = torch.zeros(3, self.ring, num_slots, dtype=dtype)  # token ids < 2**24: exact in float32
        self.num_steps = 0  # decode steps written; the next goes into column num_steps % ring
        self.ints = torch.zeros(3 + len(self.FLAGS), num_slots, dtype=torch.int64)  # one copy moves them all
        self.first, self.base, self.deadline = self.ints[0], self.ints[1], self.ints[2]
        self.flags = self.ints[3:]
        self.params = torch.zeros(4, num_slots, dtype=torch.float64)

    def length(self, slots: torch.Tensor | slice) -> torch.Tensor:
        """Tokens (prompt included) of the requests in ``slots``."""
        return self.base[slots] + (self.num_steps - self.first[slots])

    def admit(self, slots: list[int], lengths: list[int], last_pos: list[int], params: list[list[float]],
              flags: list[list[bool]]) -> int:
        """Requests of ``lengths`` tokens enter ``slots``, with the last positions
        they may sample, ``params`` [4][k] and ``flags`` [len(FLAGS)][k]; returns
        their ``first`` column, which their prefill writes."""
        first = self.num_steps - 1
        base = torch.tensor(lengths)
        self.ints[:, torch.tensor(slots)] = torch.cat([
            torch.stack([torch.full_like(base, first), base, torch.tensor(last_pos) - base + first]),
            torch.tensor(flags, dtype=torch.int64)])
        self.params[:, torch.tensor(slots)] = torch.tensor(params, dtype=torch.float64)
        return first

    def write_prefill(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.values[:, (self.num_steps - 1) % self.ring, slots] = values

    def write_step(self, values: torch.Tensor) -> None:
        """A decode step of slots ``0..n-1``: ``values`` [3, n]."""
        self.values[:, self.num_steps % self.ring, : values.shape[1]] = values
        self.num_steps += 1

    def read(self, slot: int, first: int) -> tuple[list[int], list[float], list[float]]:
        """Tokens, logprobs and raw logprobs the request in ``slot`` (admitted at
        column ``first``) sampled since its admission."""
        start, count = first % self.ring, self.num_steps - first
        if start + count <= self.ring:
            values = self.values[:, start : start + count, slot]
        else:
            values = torch.cat([self.values[:, start:, slot], self.values[:, : start + count - self.ring, slot]], 1)
        lps, raws = values[1:].tolist()
        return values[0].long().tolist(), lps, raws

    def move(self, srcs: list[int], dsts: list[int]) -> None:
        src, dst = torch.tensor([srcs, dsts])
        for t in (self.values, self.ints, self.params):
            t.index_copy_(-1, dst, t.index_select(-1, src))
