"""The weight store of ``rollout.engine.weight_dtype: fp8``: the bf16 master, plus FP8 copies of
every layer's linears that the forward reads.

    push (full | delta) ──► bf16 master (WeightStore: HF-named views, checksummed in place)
                               │ refit: the changed tensors' fused linears
                               ▼
        pass 1: quantize each into a scratch, check every block  ── any fault ─► refused, counted
        pass 2: quantize each into its live buffers (allocated once: captured graphs read them)

Quantized (:mod:`actors.engines.fp8`): each layer's fused ``qkv``, ``o``, fused ``gate_up`` and
``down`` weights, less those ``skip`` (``rollout.engine.fp8_skip``) names; those, the embedding,
norms, biases and head stay in the engine's dtype and are read from the master. The master
stays because a delta is written as sparse positions checked against the base version's
checksums, so the exact bf16 values must exist: the memory is the master plus about half of
its linears again (``weights_bytes`` in the engine's statistics).

A refit is all or nothing for the FP8 copies: pass 1 checks every changed linear (each scale
finite and positive, each block within ``amax * 2**-3`` of the master after dequantizing),
and only when all pass does pass 2 write any of them (quantization is deterministic). A refused
refit raises :class:`Fp8RefitRefused` naming the tensor, its block and the fault, counts in
``fp8_refits_refused``, and leaves the version where it was; but the push was already written
into the master, which is then ahead of the FP8 copies (and the embedding, norms, biases and head,
read from it, already hold the refused values). No undo is kept (it would cost a copy of the
weights): the store refuses every delta from then on (its base checksums would not hold anyway)
until a full push lands and is refitted, which is what the weight sync sends after a refusal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from actors.engines import fp8
from actors.engines.model import ModelConfig
from actors.engines.weights import FullWeights, WeightStore
from sync.errors import WeightSyncError

__all__ = ["Fp8RefitRefused", "Fp8WeightStore"]

#: The quantized linears of a layer: (attribute of the layer's namespace, its HF names in row order).
_LINEARS = (
    ("qkv_w", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("o_w", ("self_attn.o_proj.weight",)),
    ("gate_up_w", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("down_w", ("mlp.down_proj.weight",)),
)


def _fused_linears(cfg: ModelConfig) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every quantizable fused linear: (layer, attribute, its HF names in row order)."""
    return [(i, attr, tuple(f"model.layers.{i}.{s}" for s in suffixes))
            for i in range(cfg.num_layers) for attr, suffixes in _LINEARS]


class Fp8RefitRefused(WeightSyncError):
    """A push's FP8 re-quantization failed its check: no FP8 weight changed, the version did not
    advance; the bf16 master holds the push (the next one must be full)."""


@dataclass(frozen=True)
class _Linear:
    """One quantized linear: where its FP8 weight and scales sit in the flat buffers."""

    layer: int
    attr: str  # qkv_w | o_w | gate_up_w | down_w
    names: tuple[str, ...]  # HF names, in row order
    rows: tuple[int, ...]  # first row of each name in the fused weight
    layout: fp8.BlockLayout
    q_offset: int
    s_offset: int

    def part(self, block_row: int) -> str:
        """The HF tensor that a block row starts in, as an error names it."""
        row = block_row * fp8.BLOCK
        name = next(n for n, r in reversed(list(zip(self.names, self.rows))) if r <= row)
        return name if len(self.names) == 1 else f"{name} (fused {self.attr[:-2]})"


class Fp8WeightStore(WeightStore):
    """:class:`~actors.engines.weights.WeightStore` whose layers' linears are
    :class:`~actors.engines.fp8.Fp8Linear` views of FP8 buffers kept in step with the master.
    Off CUDA it runs the reference GEMM (tests); on CUDA the kernel :func:`fp8.choose_kernel` picked."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, mtp_layers: int = 0,
                 skip: tuple[str, ...] = ()):
        self.kernel = fp8.choose_kernel(device)
        self.num_refits_refused = 0
        self.stale = False  # a refit was refused: the master is ahead of the FP8 copies
        self.linears: list[_Linear] = []
        self._by_name: dict[str, _Linear] = {}
        q_total = s_total = 0
        shapes = cfg.param_shapes()
        fused = _fused_linears(cfg)
        if unmatched := [p for p in skip if not any(p in name for _, _, names in fused for name in names)]:
            raise ValueError(f"fp8_skip {unmatched} match no linear of the model (its names look like "
                             f"model.layers.0.self_attn.q_proj.weight)")
        for i, attr, names in fused:
            if any(pattern in name for pattern in skip for name in names):
                continue  # kept in dtype: the forward reads the master, as for the embedding
            heights = [shapes[n][0] for n in names]
            layout = fp8.BlockLayout(sum(heights), shapes[names[0]][1], self.kernel)
            rows = tuple(sum(heights[:j]) for j in range(len(names)))
            lin = _Linear(i, attr, names, rows, layout, q_total, s_total)
            self.linears.append(lin)
            self._by_name.update(dict.fromkeys(names, lin))
            q_total += layout.np * layout.kp
            s_total += layout.nb * layout.scale_cols
        # every byte written by the first refit (init); zeros keep a half-built store finite meanwhile
        self._q = torch.zeros(q_total, dtype=fp8.FP8, device=device)
        self._s = torch.ones(s_total, dtype=torch.float32, device=device)
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(cfg, device, dtype, mtp_layers=mtp_layers)  # MTP modules stay in dtype

    # ---- layout ------------------------------------------------------------------------------
    def _views(self, lin: _Linear, q_flat: torch.Tensor, s_flat: torch.Tensor,
               at_offsets: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        lay = lin.layout
        q0, s0 = (lin.q_offset, lin.s_offset) if at_offsets else (0, 0)
        return (q_flat[q0 : q0 + lay.np * lay.kp].view(lay.np, lay.kp),
                s_flat[s0 : s0 + lay.nb * lay.scale_cols].view(lay.nb, lay.scale_cols))

    def _bind(self) -> None:
        """The master's views (``WeightStore._bind``), then each layer's linears as FP8 views;
        the master's fused linears stay reachable in ``master_layers``."""
        super()._bind()
        self.master_layers = self.layers
        self.layers = [SimpleNamespace(**vars(layer)) for layer in self.master_layers]
        for lin in self.linears:
            q, s = self._views(lin, self._q, self._s)
            setattr(self.layers[lin.layer], lin.attr,
                    fp8.Fp8Linear(q, s, lin.layout.n, lin.layout.k, self.kernel))

    def master(self, lin: _Linear) -> torch.Tensor:
        """The bf16 weight [n, k] of a quantized linear (a view of the master)."""
        return getattr(self.master_layers[lin.layer], lin.attr)

    def live(self, lin: _Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Its live FP8 weight [np, kp] and scales [nb, scale_cols]."""
        return self._views(lin, self._q, self._s)

    @property
    def nbytes(self) -> int:
        """The master, the FP8 copies and their scales, and the refit's scratch when allocated."""
        extra = sum(t.numel() * t.element_size() for t in (self._q, self._s, *(self._scratch or ())))
        return super().nbytes + extra

    def to(self, device: torch.device) -> None:
        """Move the master and the FP8 buffers (``sleep(2)`` / wake) and rebind every view; the
        scratch is dropped (allocated again by the next refit)."""
        device = torch.device(device)
        self._scratch = None
        if self._q.device != device:
            self._q, self._s = self._q.to(device), self._s.to(device)
        super().to(device)
        self._bind()

    def statistics(self) -> dict[str, object]:
        return {"fp8_kernel": self.kernel, "fp8_refits_refused": self.num_refits_refused}

    # ---- pushes ------------------------------------------------------------------------------
    def load_dir(self, model_path) -> None:
        super().load_dir(model_path)
        self.refit_linears(self.linears, full=True)

    def check_update(self, update: object) -> None:
        """Refuse a delta while the master is ahead of the FP8 copies (after a refused refit)."""
        manifest = getattr(update, "manifest", None)
        if self.stale and manifest is not None and manifest.kind == "delta":
            raise WeightSyncError("fp8: the last refit was refused, so the bf16 master is ahead of the FP8 "
                                  "weights: the next push must be full")

    def refit(self, update: object) -> None:
        """Re-quantize what ``update`` (just written into the master) changed: every linear for a
        full update, those of its changed entries for a delta."""
        manifest = getattr(update, "manifest", None)
        if isinstance(update, FullWeights) or manifest is None or manifest.kind == "full":
            self.refit_linears(self.linears, full=True)
            return
        names = {e.name for e in manifest.entries if e.num_changed > 0}
        self.refit_linears(self.linears_of(names), full=False)

    def linears_of(self, names: Iterable[str]) -> list[_Linear]:
        """The quantized linears that hold any of the HF ``names``, in layer order."""
        hit = {id(self._by_name[n]) for n in names if n in self._by_name}
        return [lin for lin in self.linears if id(lin) in hit]

    def quantize(self, lin: _Linear, w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """Quantize the master weight ``w`` of ``lin`` into ``q_out`` / ``s_out`` (the seam a test
        replaces to inject faults; both passes of a refit call it)."""
        fp8.quantize_blocks(w, q_out, s_out)

    @torch.no_grad()
    def refit_linears(self, linears: list[_Linear], *, full: bool) -> None:
        """Check every one of ``linears`` quantized into the scratch (one read-back for all), then
        quantize them into their live buffers; a fault raises :class:`Fp8RefitRefused`, counted,
        with nothing live written. ``full``: the master holds a whole push (a success clears ``stale``)."""
        if linears:
            faults = []
            for lin in linears:
                q, s = self._scratch_for(lin)
                self.quantize(lin, self.master(lin), q, s)
                faults.append(fp8.block_faults(self.master(lin), q, s).any())
            if bool(torch.stack(faults).any()):
                self.num_refits_refused += 1
                self.stale = True
                bad = next(lin for lin, f in zip(linears, faults) if bool(f))
                raise Fp8RefitRefused(f"fp8 refit refused: {self._describe(bad)}")
            for lin in linears:
                self.quantize(lin, self.master(lin), *self.live(lin))
        if full:
            self.stale = False

    def _scratch_for(self, lin: _Linear) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None:  # sized to the largest linear; kept for the next push
            q_n = max(x.layout.np * x.layout.kp for x in self.linears)
            s_n = max(x.layout.nb * x.layout.scale_cols for x in self.linears)
            self._scratch = (torch.empty(q_n, dtype=fp8.FP8, device=self._q.device),
                             torch.empty(s_n, dtype=torch.float32, device=self._q.device))
        return self._views(lin, *self._scratch, at_offsets=False)

    def _describe(self, lin: _Linear) -> str:
        """The first faulty block of ``lin`` (quantized again into the scratch) in one line."""
        w = self.master(lin)
        q, s = self._scratch_for(lin)
        self.quantize(lin, w, q, s)
        faults = fp8.block_faults(w, q, s).nonzero()
        if not len(faults):
            return f"{lin.part(0)}: a block failed its check, and passed it quantized again"
        i, j = (int(v) for v in faults[0].tolist())
        where = f"{lin.part(i)} block ({i}, {j})"
        scale = float(s[i, j])
        if not (scale > 0 and scale != float("inf")):
            return f"{where} scale {scale}"
        block = w[i * fp8.BLOCK : (i + 1) * fp8.BLOCK, j * fp8.BLOCK : (j + 1) * fp8.BLOCK].float()
        got = fp8.dequantize_blocks(q, s)[i * fp8.BLOCK : i * fp8.BLOCK + block.shape[0],
                                          j * fp8.BLOCK : j * fp8.BLOCK + block.shape[1]]
        err, amax = float((got - block).abs().max()), float(block.abs().max())
        return f"{where} dequantizes {err:.3g} away from the weights (amax {amax:.3g}, bound {amax / 8:.3g})"
