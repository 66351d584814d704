"""The decoder forward of the Llama / Qwen2 / Qwen3 families, written against
Hugging Face-named weights so that the engine owns the KV cache layout and can
capture decode steps as CUDA graphs.

    prefill(tokens [B, T], slots [B], last [B])  -> logits [B, V]   (writes KV[:, slots, :, :T])
    decode(tokens [B], positions [B])            -> logits [B, V]   (writes KV[:, :B, :, pos])

Logits come in the model's dtype; the sampler upcasts what it needs.

Decode runs on the first ``B`` cache slots: the engine keeps running
requests packed into slots ``0..n-1`` so no gather of the cache is needed.
Numerics follow Hugging Face (RMSNorm in fp32, RoPE with ``rotate_half``,
cos/sin cast to the activation dtype) so fp32 outputs match it to ~1e-5.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.engines import fp8, triton_kernels, triton_layers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face ``config.json`` the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3-style scaling parameters, None = plain RoPE
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (always for Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported by the torch engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported by the torch engine")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by the torch engine")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type={rope_type!r} is not supported (default, llama3)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )

    @classmethod
    def from_dir(cls, model_path: str | Path) -> "ModelConfig":
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ValueError(f"model_path={str(model_path)!r} has no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape, in an order that keeps q/k/v and gate/up adjacent
        (the weight store lays them out contiguously so they fuse as views)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] (fp32), llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def prefer_shape_agnostic_attention(device: str | torch.device) -> None:
    """On CUDA, take cuDNN out of ``scaled_dot_product_attention``'s choices (process-wide).

    cuDNN's attention builds an execution plan for every new (batch, length)
    shape, which costs more host time than a whole prefill of a small model
    takes. RL shapes change every call
    (group sizes, response lengths), so flash / memory-efficient attention,
    which need no plan, are faster end to end for both the engine's prefill
    and the trainer. ``ASYNCRL_CUDNN_SDPA=1`` keeps cuDNN enabled.
    """
    if torch.device(device).type == "cuda" and os.environ.get("ASYNCRL_CUDNN_SDPA", "0") != "1":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused kernel on CUDA; computes in fp32 like HF (which rounds once more, before the weight)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or the FP8 block-scaled GEMM when ``w`` is an :class:`~actors.engines.fp8.Fp8Linear`
    (``rollout.engine.weight_dtype: fp8``): the one place the forward's linears branch."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return fp8.linear(x, w, b)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(h, norm_w, qkv_w, qkv_b, q_norm, k_norm, cos, sin,
                     num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """Pre-attention half of a layer (pure: compiled as one unit for decode).
    ``cos`` / ``sin`` None: q and k come back without RoPE (the decode
    attention kernel applies it)."""
    x = _rms_norm(h, norm_w, eps)
    qkv = linear(x, qkv_w, qkv_b)
    nq, nkv = num_heads * head_dim, num_kv_heads * head_dim
    v = qkv[..., nq + nkv :].unflatten(-1, (num_kv_heads, head_dim))
    if q_norm is not None:
        q = _rms_norm(qkv[..., :nq].unflatten(-1, (num_heads, head_dim)), q_norm, eps)
        k = _rms_norm(qkv[..., nq : nq + nkv].unflatten(-1, (num_kv_heads, head_dim)), k_norm, eps)
        qk = torch.cat([q, k], dim=-2)
    else:  # q and k are adjacent: rotate them together (fewer kernels per step)
        qk = qkv[..., : nq + nkv].unflatten(-1, (num_heads + num_kv_heads, head_dim))
    if cos is not None:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        qk = qk * cos + _rotate_half(qk) * sin
    return qk[..., :num_heads, :], qk[..., num_heads:, :], v  # views: no copies


def attention_output_and_mlp(h, attn, o_w, norm_w, gate_up_w, down_w, eps: float):
    """Post-attention half of a layer: o_proj, residual, norm, SwiGLU MLP, residual."""
    h = h + linear(attn, o_w)
    x = _rms_norm(h, norm_w, eps)
    gate, up = linear(x, gate_up_w).chunk(2, dim=-1)
    return h + linear(F.silu(gate) * up, down_w)


class Model:
    """Stateless forward over a :class:`~actors.engines.weights.WeightStore`
    and a :class:`~actors.engines.kv_cache.KVCache`."""

    def __init__(self, cfg: ModelConfig, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 compile_decode: bool | str = False, fp8_weights: bool = False):
        self.cfg = cfg
        # Decode is ~40 small kernels a layer, each a few microseconds even inside a CUDA
        # graph; compiled, the elementwise work (norms, RoPE, SwiGLU, residuals) fuses.
        # The KV-cache writes and attention stay outside: compiled, a write into the
        # cache became a copy of the whole layer cache (measured on an H200).
        self._decode_fns = (None, None)
        if compile_decode:  # True, or a torch.compile mode such as "max-autotune-no-cudagraphs"
            mode = compile_decode if isinstance(compile_decode, str) else None
            self._decode_fns = (torch.compile(attention_inputs, fullgraph=True, mode=mode),
                                torch.compile(attention_output_and_mlp, fullgraph=True, mode=mode))
        self.dtype = dtype
        self.device = device
        prefer_shape_agnostic_attention(device)  # prefill shapes change every call
        pos = torch.arange(max_model_len, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.key_positions = torch.arange(max_model_len, device=device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # decode attention (cache write + attention) as one Triton kernel on CUDA; SDPA elsewhere
        self.fused_attention = triton_kernels.attention_supported(device, cfg.head_dim)
        # decode steps of <= 64 rows: Triton matmuls with the norms, SwiGLU and residuals fused
        # (six launches a layer); ASYNCRL_TRITON_LAYERS=0 keeps the cuBLAS path; they read bf16
        # weights, so FP8 linears (``fp8_weights``) take the FP8 GEMM instead
        self.triton_layers = (self.fused_attention and triton_layers.supported(device, dtype) and not cfg.qk_norm
                              and not fp8_weights
                              and os.environ.get("ASYNCRL_TRITON_LAYERS", "1") != "0")

    def _qkv(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn=None):
        """h [..., hidden] -> q [..., Hq, D], k/v [..., Hkv, D] with RoPE applied."""
        cfg = self.cfg
        return (fn or attention_inputs)(
            h, layer.input_norm, layer.qkv_w, layer.qkv_b, layer.q_norm, layer.k_norm, cos, sin,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def _mlp_residual(self, layer, h: torch.Tensor, attn: torch.Tensor, fn=None) -> torch.Tensor:
        return (fn or attention_output_and_mlp)(
            h, attn, layer.o_w, layer.post_norm, layer.gate_up_w, layer.down_w, self.cfg.rms_norm_eps)

    def _logits(self, weights, h: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler reads them as they are (no fp32 copy of [B, V])."""
        h = _rms_norm(h, weights.final_norm, self.cfg.rms_norm_eps)
        return F.linear(h, weights.lm_head)

    @torch.inference_mode()
    def prefill(self, weights, kv, tokens: torch.Tensor, slots: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts tokens [B, T] into cache ``slots`` [B]; returns
        the logits [B, V] at ``last_index`` [B] (each prompt's last token).
        Padding sits after each prompt, so a causal mask alone keeps it out of
        every real token's attention; its cache entries are overwritten later."""
        h = self.prefill_layers(weights, kv, tokens, slots)
        h = h[torch.arange(tokens.shape[0], device=h.device), last_index]
        return self._logits(weights, h)

    @torch.inference_mode()
    def prefill_layers(self, weights, kv, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`prefill`'s decoder layers: the residual stream [B, T, hidden] after the
        last layer, before the final norm (MTP drafting reads every position of it)."""
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        h = F.embedding(tokens, weights.embed)
        for n, layer in enumerate(weights.layers):
            q, k, v = self._qkv(layer, h, cos, sin)  # [B, T, H, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
            kv.k[n][slots, :, :T] = k
            kv.v[n][slots, :, :T] = v
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, scale=self.scale,
                enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads,
            )
            h = self._mlp_residual(layer, h, a.transpose(1, 2).flatten(2))
        return h

    @torch.inference_mode()
    def decode(self, weights, kv, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of the first B slots: tokens/positions [B] ->
        logits [B, V]. Shapes depend on B only (CUDA-graph friendly)."""
        cfg = self.cfg
        B = tokens.shape[0]
        if self.triton_layers and B <= triton_layers.MAX_ROWS:
            return self._decode_triton_layers(weights, kv, tokens, positions)
        fused = self.fused_attention
        cos = sin = None  # fused: the attention kernel applies RoPE
        if not fused:
            cos, sin = self.cos[positions], self.sin[positions]  # [B, D]
            rows = torch.arange(B, device=tokens.device)
            # key j of row b is visible iff j <= positions[b]: [B, 1, 1, max_len]
            mask = (self.key_positions[: kv.max_len][None, :] <= positions[:, None]).view(B, 1, 1, kv.max_len)
            group = cfg.num_heads // cfg.num_kv_heads
        h = F.embedding(tokens, weights.embed)
        pre, post = self._decode_fns
        for n, layer in enumerate(weights.layers):
            q, k, v = self._qkv(layer, h, cos, sin, pre)  # [B, H, D]
            if fused:
                a = triton_kernels.decode_attention(q, k, v, kv.k[n], kv.v[n], positions, self.scale,
                                                    self.cos, self.sin)
            else:
                kv.k[n][rows, :, positions] = k
                kv.v[n][rows, :, positions] = v
                # the G query heads sharing a KV head act as G queries of one head: no K/V repeat
                a = F.scaled_dot_product_attention(
                    q.reshape(B, cfg.num_kv_heads, group, cfg.head_dim), kv.k[n][:B], kv.v[n][:B],
                    attn_mask=mask, scale=self.scale)  # [B, Hkv, G, D]
            h = self._mlp_residual(layer, h, a.reshape(B, cfg.num_heads * cfg.head_dim), post)
        return self._logits(weights, h)

    def _decode_triton_layers(self, weights, kv, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` in six launches a layer (``triton_layers``): the residual ``h`` is
        updated in place, and each norm adds the partial sums of the matmul before it."""
        cfg, eps, B = self.cfg, self.cfg.rms_norm_eps, tokens.shape[0]
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        layers = weights.layers
        h = F.embedding(tokens, weights.embed)
        x = triton_layers.add_rms_norm(None, h, layers[0].input_norm, eps)
        for n, layer in enumerate(layers):
            qkv = triton_layers.linear(x, layer.qkv_w, layer.qkv_b)
            q = qkv[:, :nq].view(B, cfg.num_heads, cfg.head_dim)
            k = qkv[:, nq : nq + nkv].view(B, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, nq + nkv :].view(B, cfg.num_kv_heads, cfg.head_dim)
            a = triton_kernels.decode_attention(q, k, v, kv.k[n], kv.v[n], positions, self.scale, self.cos, self.sin)
            x = triton_layers.add_rms_norm(triton_layers.linear_partials(a.view(B, nq), layer.o_w), h,
                                           layer.post_norm, eps)
            act = triton_layers.gate_up_silu(x, layer.gate_up_w)
            norm = layers[n + 1].input_norm if n + 1 < len(layers) else weights.final_norm
            x = triton_layers.add_rms_norm(triton_layers.linear_partials(act, layer.down_w), h, norm, eps)
        return F.linear(x, weights.lm_head)
