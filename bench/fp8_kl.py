"""How far the FP8 engine's next-token distributions sit from the full-precision engine's on the
same weights: KL(full || fp8) per token, at the positions where rollouts sample.

    python -m bench.fp8_kl --model models/smollm2-135m-instruct --device cuda   # bf16 against FP8 kernels
    python -m bench.fp8_kl --model DIR --device cpu     # fp32 against the FP8 reference GEMM (no GPU)
    python -m bench.fp8_kl --model DIR --fp8-skip q_proj   # with rollout.engine.fp8_skip

Prints one JSON object (and writes it to ``--out``): the KL's mean, median, p99 and max over the
response tokens of 16 rollouts of the step-by-step task (T=1, up to 96 tokens each) that the
full-precision engine samples; both engines then read each whole sequence (teacher forcing). Beside
it, ``decode_vs_forced_logprob``: for each engine, how far the log-probs it recorded while sampling
its own rollouts sit from the same tokens read back by one prefill of that engine; and
``sampler_gap``: the full-precision over FP8 log-ratio at the FP8 engine's own samples, and the share of
them outside ``ppo_clip``'s [0.8, 1.2] band.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

import loop
from actors.engines import fp8 as fp8_gemm
from actors.engines import GenerateRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine
from bench.speculative import TASK
from policies.tasks import make_task


def kl_per_row(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in fp32."""
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


class _Rollouts:
    """16 prompts of the step-by-step task where ``path`` has a tokenizer, else random ones, and
    the engines that sample them (T=1, up to 96 tokens) or read whole sequences back."""

    def __init__(self, path: str, device: str) -> None:
        self.path, self.device = path, device
        self.dtype = "bfloat16" if device == "cuda" else "float32"
        if (Path(path) / "tokenizer_config.json").is_file():
            task = make_task("text_arithmetic", model_path=path, **TASK)
            self.prompts, self.stop = [p.prompt_ids for p in task.eval_prompts(16)], tuple(task.stop_token_ids)
        else:
            vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
            self.prompts = torch.randint(1, vocab, (16, 24), generator=torch.Generator().manual_seed(6)).tolist()
            self.stop = ()

    def engine(self, **options) -> TorchEngine:
        return TorchEngine(self.path, device=self.device, dtype=self.dtype, max_num_seqs=16, max_model_len=512,
                           **options)

    def sample(self, **options) -> list[tuple[list[int], list[float]]]:
        """Each prompt's response and the log-probs the engine recorded while decoding it."""
        async def run() -> list[tuple[list[int], list[float]]]:
            e = self.engine(**options)
            await e.setup()
            try:
                outs = await asyncio.gather(*(e.generate(GenerateRequest(
                    request_id=f"r{i}", prompt_ids=p, max_tokens=96,
                    sampling=SamplingParams(temperature=1.0, seed=i, stop_token_ids=self.stop)))
                    for i, p in enumerate(self.prompts)))
                return [(list(o.token_ids), list(o.logprobs)) for o in outs]
            finally:
                await e.close()
        return loop.run(run())

    def forced(self, responses: list[list[int]], **options) -> list[torch.Tensor]:
        """Each prompt + response read whole by one prefill: the logits [len(response), V] (fp32,
        on the host) at the positions that sampled the response's tokens."""
        async def run() -> list[torch.Tensor]:
            e = self.engine(**options)
            await e.setup()
            try:
                core, out, d = e._core, [], self.device
                for p, r in zip(self.prompts, responses):
                    h = core.model.prefill_layers(core.weights, core.kv, torch.tensor([p + r], device=d),
                                                  torch.tensor([0], device=d))
                    out.append(core.model._logits(core.weights, h[0, len(p) - 1 : len(p) + len(r) - 1]).float().cpu())
                return out
            finally:
                await e.close()
        return loop.run(run())


def rollout_kl(path: str, device: str, **fp8_options) -> torch.Tensor:
    """KL(full || fp8) per token at every response position of 16 rollouts (T=1, up to 96 tokens)
    that the full-precision engine samples, each sequence teacher-forced through both engines.
    The positions a rollout samples at are where the trainer's off-policy correction meets the gap."""
    r = _Rollouts(path, device)
    responses = [tokens for tokens, _ in r.sample()]
    full, quant = r.forced(responses), r.forced(responses, weight_dtype="fp8", **fp8_options)
    return torch.cat([kl_per_row(a, b) for a, b in zip(full, quant)])


def _recorded_and_forced(r: _Rollouts, sampler: dict, reader: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs the ``sampler`` engine recorded for its rollouts' tokens, and those the
    ``reader`` engine gives the same tokens in one prefill (flat over every response token)."""
    samples = r.sample(**sampler)
    forced = r.forced([tokens for tokens, _ in samples], **reader)
    recorded = torch.cat([torch.tensor(lps) for _, lps in samples])
    read = torch.cat([f.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
                      for (tokens, _), f in zip(samples, forced)])
    return recorded, read


def decode_vs_forced(path: str, device: str, **options) -> dict[str, float]:
    """How far an engine's log-probs of its own sampled tokens, recorded while decoding, sit from
    the same tokens read back by one prefill of the same engine: |difference| mean, RMS and max
    over the response tokens. 0 up to summation order in full precision; with FP8 a tiny change of
    order flips activations' e4m3 roundings, which cascade through the layers."""
    recorded, read = _recorded_and_forced(_Rollouts(path, device), options, options)
    d = (recorded - read).abs()
    return {"abs_mean": float(d.mean()), "rms": float(d.pow(2).mean().sqrt()), "max": float(d.max())}


def sampler_gap(path: str, device: str, **fp8_options) -> dict[str, float]:
    """What an on-policy PPO step would see at its first update with FP8 rollout: the log-ratio of
    the full-precision model (the trainer's weights) over the FP8 engine at the tokens the FP8
    engine sampled, as its mean and RMS, and the share of tokens whose ratio starts outside
    ``ppo_clip``'s [0.8, 1.2] band."""
    recorded, read = _recorded_and_forced(_Rollouts(path, device), {"weight_dtype": "fp8", **fp8_options}, {})
    log_ratio = read - recorded
    outside = (log_ratio > math.log(1.2)) | (log_ratio < math.log(0.8))
    return {"log_ratio_mean": float(log_ratio.mean()), "log_ratio_rms": float(log_ratio.pow(2).mean().sqrt()),
            "outside_0.8_1.2": float(outside.float().mean())}


def _fake_groups(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` [n, k] rounded through e4m3 with one scale per ``rows`` x 128 block, fp32, [n, k]."""
    n, k = w.shape
    n_pad, k_pad = -n % rows, -k % fp8_gemm.BLOCK
    x = F.pad(w.float(), (0, k_pad, 0, n_pad)).view((n + n_pad) // rows, rows, -1, fp8_gemm.BLOCK)
    scale = x.abs().amax(dim=(1, 3), keepdim=True).clamp_min(fp8_gemm.AMAX_FLOOR) / fp8_gemm.E4M3_MAX
    return (x / scale).to(fp8_gemm.FP8).float().mul(scale).view(n + n_pad, k + k_pad)[:n, :k]


@contextlib.contextmanager
def ablation(weight_rows: int, activations: bool):
    """The reference GEMM with other roundings, to see where the FP8 error comes from: weights
    with one scale per ``weight_rows`` x 128 block (the engine's is 128), activations quantized
    1x128 (the engine's) or kept in full precision. Patches :mod:`actors.engines.fp8` for the
    ``with`` block; the reference path only (``--device cpu``)."""
    fake: dict[int, torch.Tensor] = {}
    quantize_blocks, linear = fp8_gemm.quantize_blocks, fp8_gemm.linear

    def quantize(w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
        quantize_blocks(w, q_out, scale_out)
        fake[q_out.data_ptr()] = _fake_groups(w, weight_rows)

    def ablated(x: torch.Tensor, w: fp8_gemm.Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, w.in_features).float()
        if activations:
            q, s = fp8_gemm.quantize_rows(x2, w.weight.shape[1])
            x2 = fp8_gemm.dequantize_rows(q, s)[:, : w.in_features]
        out = F.linear(x2, fake[w.weight.data_ptr()], bias).to(x.dtype)
        return out.reshape(*x.shape[:-1], w.out_features)

    fp8_gemm.quantize_blocks, fp8_gemm.linear = quantize, ablated
    try:
        yield
    finally:
        fp8_gemm.quantize_blocks, fp8_gemm.linear = quantize_blocks, linear


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--fp8-skip", nargs="*", default=[], help="rollout.engine.fp8_skip patterns")
    ap.add_argument("--ablate", metavar="WEIGHT_ROWS:ACTIVATIONS", default=None,
                    help="reference GEMM only: KL with weight scales per WEIGHT_ROWS x 128 block and activations "
                         "fp8 or full (e.g. 1:full); no other measurement")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args(argv)
    fp8 = {"fp8_skip": tuple(args.fp8_skip), "fp8_reference_for_tests": args.device == "cpu"}
    result = _ablated(ap, args, fp8) if args.ablate else _measured(args, fp8)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


def _ablated(ap: argparse.ArgumentParser, args: argparse.Namespace, fp8: dict) -> dict:
    """``--ablate ROWS:ACTIVATIONS``: the KL alone, under :func:`ablation`."""
    rows, _, acts = args.ablate.partition(":")
    if args.device != "cpu" or not rows.isdigit() or int(rows) < 1 or acts not in ("fp8", "full"):
        ap.error(f"--ablate {args.ablate!r}: ROWS:ACTIVATIONS, ROWS a positive integer, ACTIVATIONS fp8 or full, "
                 f"with --device cpu (it patches the reference GEMM)")
    with ablation(int(rows), acts == "fp8"):
        kl = rollout_kl(args.model, args.device, **fp8)
    return {"bench": "fp8_kl", "model": args.model, "ablate": {"weight_block_rows": int(rows), "activations": acts},
            "num_tokens": kl.numel(), "kl_mean": float(kl.mean()), "kl_median": float(kl.median())}


def _measured(args: argparse.Namespace, fp8: dict) -> dict:
    """The KL, each engine's decode against its prefill, and the sampler gap."""
    kl = rollout_kl(args.model, args.device, **fp8)
    return {"bench": "fp8_kl", "model": args.model, "device": args.device,
            "machine": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
            "torch": torch.__version__, "baseline": "bfloat16" if args.device == "cuda" else "float32",
            "fp8_gemm": "kernel" if args.device == "cuda" else "reference", "fp8_skip": args.fp8_skip,
            "num_tokens": kl.numel(), "kl_mean": float(kl.mean()), "kl_median": float(kl.median()),
            "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max()),
            # each engine's recorded log-prob of its own sampled tokens against one prefill's
            "decode_vs_forced_logprob": {
                "full": decode_vs_forced(args.model, args.device),
                "fp8": decode_vs_forced(args.model, args.device, weight_dtype="fp8", **fp8)},
            # full precision over FP8 at the FP8 engine's own samples: what ppo_clip clips against
            "sampler_gap": sampler_gap(args.model, args.device, **fp8)}


if __name__ == "__main__":
    main()
