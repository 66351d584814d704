"""Scaled inputs for ``python -m bench.simulate --model 0.5b,7b --gpus 8,32,128``.

Every figure below is either measured on one H200 (file named) or an assumption
(named ``assumed``); the JSON the command prints repeats them. Schedules compared
per GPU count N:

    sync_colocated   all N GPUs generate, then all N train (verl's hybrid-engine
                     baseline, the one the published speedups are over)
    sync             disaggregated: R GPUs generate, N - R train, in turn
    one_step_off     disaggregated, generation of k+1 beside training of k
    fully_async      disaggregated, staleness_threshold s, partial rollouts (abort)

For the disaggregated ones the rollout/trainer split R is searched.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from bench.simulate_model import Inputs, LengthDist, Schedule, simulate

H200_PEAK_FLOPS = 989e12  # dense bf16
# assumed: ~70% of 4.8 TB/s (weight_sync_h200_median.json copies at 4.02 TB/s, read + write)
ASSUMED_HBM_READ_BYTES_PER_S = 3.3e12
# engine_h200_final_b64.json: 0.875 ms a step at 64 rows; engine_h200.json: 1.504 ms at 256 rows
# (Qwen2.5-0.5B shape, prompt 128 + 256 new tokens, so ~256 tokens of context on average).
MEASURED_STEP_S = {64: 0.875e-3, 256: 1.5043e-3}
MEASURED_CTX = 256
# h200_trainer_and_length_probe.json (358M, torch backend, one H200): 64 samples x 390.3 tokens in
# 328.2 ms, 64 x 32.1 tokens in 94.9 ms -> 74.0 ms fixed + 10.18 µs a token (21% MFU at 6N FLOPs/token).
MEASURED_TRAIN = {"params": 357_916_928, "fixed_s": 0.0740, "per_token_s": 10.18e-6}
# weight_sync_h200_median.json: a full 0.5B push over CUDA IPC, median 7.8 ms; in-run pushes
# (async_vs_sync_h200_text_v6_fair.json, sync_ms_mean) 21.6 ms: the fixed part of a push.
MEASURED_PUSH_FIXED_S = 0.0216
MEASURED_IPC_PUSH_S_PER_BYTE = 7.8e-3 / 988_170_240

MODELS = {
    # Qwen2.5 shapes: params, layers, KV bytes per token (layers x 2 x kv_heads x head_dim x 2 bytes)
    "0.5b": {"params": 494_032_768, "layers": 24, "kv_bytes_per_token": 24 * 2 * 2 * 64 * 2, "train_mfu": None},
    "7b": {"params": 7_615_616_512, "layers": 28, "kv_bytes_per_token": 28 * 2 * 4 * 128 * 2, "train_mfu": 0.35},
}
ASSUMED = {
    "prompt_len": 512,
    "samples_per_gpu_per_step": 32,
    "group_size": 8,
    "response_mean": 1024,
    "response_cap": 8192,
    "tails": {"light (alpha 3)": 3.0, "heavy (alpha 1.2)": 1.2},
    "max_running_per_engine": 256,
    "dp_efficiency": 0.9,
    "inter_node_broadcast_bytes_per_s": 25e9,
    "staleness_threshold": 1.0,
    "max_staleness": 2,
    "train_mfu_7b": 0.35,
    "optimizer_bytes_per_param": 32,
}


def _decode_fit() -> dict[str, float]:
    """Split the measured 0.5B step into launch overhead, weight reads, KV reads and compute."""
    m = MODELS["0.5b"]
    per_seq = (MEASURED_STEP_S[256] - MEASURED_STEP_S[64]) / (256 - 64)
    base = MEASURED_STEP_S[64] - 64 * per_seq
    weights_s = 2 * m["params"] / ASSUMED_HBM_READ_BYTES_PER_S
    kv_s = MEASURED_CTX * m["kv_bytes_per_token"] / ASSUMED_HBM_READ_BYTES_PER_S
    compute_s = per_seq - kv_s
    return {"launch_s_per_layer": (base - weights_s) / m["layers"],
            "decode_mfu": 2 * m["params"] / compute_s / H200_PEAK_FLOPS}


def inputs_for(model: str, total_gpus: int, tail_alpha: float, cap: int | None = None) -> tuple[Inputs, dict[str, Any]]:
    m, a, fit = MODELS[model], ASSUMED, _decode_fit()
    n, bytes_w = m["params"], 2 * m["params"]
    ctx = a["prompt_len"] + a["response_mean"] / 2
    decode_base = fit["launch_s_per_layer"] * m["layers"] + bytes_w / ASSUMED_HBM_READ_BYTES_PER_S
    decode_per_seq = (ctx * m["kv_bytes_per_token"] / ASSUMED_HBM_READ_BYTES_PER_S
                      + 2 * n / (H200_PEAK_FLOPS * fit["decode_mfu"]))
    prefill_per_token = 2 * n / (H200_PEAK_FLOPS * fit["decode_mfu"])
    if m["train_mfu"] is None:  # 0.5B: the measured 358M rate, scaled by parameters
        per_token = MEASURED_TRAIN["per_token_s"] * n / MEASURED_TRAIN["params"]
    else:
        per_token = 6 * n / (H200_PEAK_FLOPS * m["train_mfu"])
    # AdamW's pass over its state on one GPU; sharded over the trainer GPUs (_run)
    optimizer_s = a["optimizer_bytes_per_param"] * n / ASSUMED_HBM_READ_BYTES_PER_S
    push_net = MEASURED_PUSH_FIXED_S + bytes_w / a["inter_node_broadcast_bytes_per_s"]
    b = a["samples_per_gpu_per_step"] * total_gpus
    inp = Inputs(decode_base_s=decode_base, decode_per_seq_s=decode_per_seq, prefill_per_token_s=prefill_per_token,
                 train_fixed_s=MEASURED_TRAIN["fixed_s"], train_per_token_s=per_token,
                 push_s=push_net, push_paused_s=bytes_w / a["inter_node_broadcast_bytes_per_s"],
                 push_encode_s=MEASURED_PUSH_FIXED_S / 2,
                 lengths=LengthDist.with_mean(a["response_mean"], tail_alpha, cap or a["response_cap"]),
                 prompt_len=a["prompt_len"], samples_per_step=b, group_size=a["group_size"],
                 dp_efficiency=a["dp_efficiency"], max_running=a["max_running_per_engine"])
    derived = {"decode_step_s_at_batch_64": round(inp.decode_s(64), 5),
               "decode_step_s_at_batch_256": round(inp.decode_s(256), 5),
               "prefill_s_per_token": prefill_per_token, "train_s_per_token_one_gpu": per_token,
               "optimizer_s_one_gpu": round(optimizer_s, 4), "push_s_disaggregated": round(push_net, 4),
               "push_s_colocated": round(MEASURED_PUSH_FIXED_S + MEASURED_IPC_PUSH_S_PER_BYTE * bytes_w, 4),
               "samples_per_step": b}
    return inp, derived


MAX_SIMULATED_ENGINES = 8


def _run(inp: Inputs, sched: Schedule, optimizer_s: float, r: int, t: int, steps: int) -> tuple[float, float]:
    """(trained tokens/s, steps/s) of R rollout and T trainer GPUs. Engines are independent and
    alike, so more than 8 are simulated as 8 with the batch cut by the same factor and the
    trainer's per-token time raised by it (the trainer's rate per rollout GPU is kept); only the
    slowest sample of a smaller batch is less extreme, which favours the synchronous schedules."""
    scale = max(1.0, r / MAX_SIMULATED_ENGINES)
    g = inp.group_size
    b_sim = max(g, round(inp.samples_per_step / scale / g) * g)
    scale = inp.samples_per_step / b_sim
    sim_inp = dataclasses.replace(inp, num_rollout=max(1, round(r / scale)), num_trainer=t,
                                  samples_per_step=b_sim, train_per_token_s=inp.train_per_token_s * scale,
                                  train_fixed_s=MEASURED_TRAIN["fixed_s"] + optimizer_s / t)
    res = simulate(sim_inp, sched, num_steps=steps, warmup_steps=2)
    return res.trained_tokens_per_s * scale, res.steps_per_s


SCALING_RULES = (
    "decode step: launch overhead by layers + bf16 weight bytes / HBM bandwidth + per row (KV bytes of "
    "the mean context / bandwidth + 2N FLOPs at the fitted decode MFU); prefill 2N FLOPs a token at that "
    "MFU; trainer 0.5B: the measured rate x params ratio, 7B: 6N FLOPs a token at 35% MFU; plus 74 ms "
    "fixed and an AdamW pass over 32 bytes a param sharded over the trainer GPUs; data parallel at 0.9 "
    "efficiency; push across nodes: 21.6 ms + bf16 weights at 25 GB/s; colocated switch: the measured "
    "CUDA IPC push scaled by bytes (no KV or optimizer offload counted: favours sync_colocated)")


def scaling(models: list[str], gpus: list[int], machine: str, steps: int = 10) -> dict[str, Any]:
    """Predictions per schedule for each model, tail and GPU count (see the module docstring)."""
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ValueError(f"--model {','.join(unknown) or '(none)'}: known models are {', '.join(MODELS)}")
    if not gpus or min(gpus) < 2:
        raise ValueError(f"--gpus {gpus}: need GPU counts of at least 2")
    fit = _decode_fit()
    out: dict[str, Any] = {
        "bench": "simulate (scaling)",
        "command": f"python -m bench.simulate --model {','.join(models)} --gpus {','.join(map(str, gpus))}",
        "machine": machine,
        "what": "trained response tokens/s per schedule, one H200 per engine (TP 1) and per trainer rank; "
                "disaggregated schedules at the best rollout/trainer split found (rollout GPUs R of N: "
                "a grid of N/8, then N/16 either side of its best); 10 timed steps after 2 warm-up "
                "steps per simulation",
        "measured": {
            "decode": "engine_h200*.json: 0.875 ms (64 rows) and 1.504 ms (256 rows) a decode step of the "
                      f"0.5B shape, split into {fit['launch_s_per_layer'] * 1e6:.1f} µs launch overhead a "
                      "layer, weights read at the assumed bandwidth, KV read per row, and compute at "
                      f"{fit['decode_mfu']:.0%} of peak (the fit)",
            "train": "h200_trainer_and_length_probe.json: 74.0 ms fixed + 10.18 µs a token at 358M "
                     "(two sample lengths)",
            "push": "weight_sync_h200_median.json (7.8 ms a 0.5B push, CUDA IPC) and the in-run push of "
                    "async_vs_sync_h200_text_v6_fair.json (21.6 ms): the fixed part",
        },
        "assumed": {**ASSUMED, "hbm_read_bytes_per_s": ASSUMED_HBM_READ_BYTES_PER_S,
                    "scaling_rules": SCALING_RULES},
        "results": [],
    }
    for model in models:
        for tail_name, alpha in ASSUMED["tails"].items():
            for n in gpus:
                inp, derived = inputs_for(model, n, alpha)
                opt_s = derived["optimizer_s_one_gpu"]
                row: dict[str, Any] = {"model": model, "tail": tail_name, "gpus": n, "inputs_derived": derived,
                                       "schedules": {}}
                colo = dataclasses.replace(inp, push_s=derived["push_s_colocated"],
                                           push_paused_s=derived["push_s_colocated"])
                tok, sps = _run(colo, Schedule("sync"), opt_s, n, n, steps)
                row["schedules"]["sync_colocated"] = {"tokens_per_s": round(tok), "steps_per_s": round(sps, 4),
                                                      "rollout_gpus": n}
                scheds = {"sync": Schedule("sync"), "one_step_off": Schedule("one_step_off"),
                          "fully_async": Schedule("fully_async", staleness_threshold=ASSUMED["staleness_threshold"],
                                                  max_staleness=ASSUMED["max_staleness"], in_flight="abort",
                                                  overlap_push=True)}
                for name, sched in scheds.items():
                    rg, tok, sps = _best(inp, sched, opt_s, n, steps)
                    row["schedules"][name] = {"tokens_per_s": round(tok), "steps_per_s": round(sps, 4),
                                              "rollout_gpus": rg}
                base = row["schedules"]["sync_colocated"]["tokens_per_s"]
                fa_tok = row["schedules"]["fully_async"]["tokens_per_s"]
                row["fully_async_over_sync_colocated"] = round(fa_tok / base, 2)
                row["fully_async_over_best_sync"] = round(fa_tok / max(base, row["schedules"]["sync"]["tokens_per_s"]), 2)
                out["results"].append(row)
    out["tail_sweep"] = tail_sweep(models, max(gpus), steps)
    return out


def _best(inp: Inputs, sched: Schedule, opt_s: float, n: int, steps: int) -> tuple[int, float, float]:
    """(rollout GPUs, trained tokens/s, steps/s) at the best split."""
    runs: dict[int, tuple[float, float]] = {}

    def evaluate(rg: int) -> float:
        runs[rg] = _run(inp, sched, opt_s, rg, n - rg, steps)
        return runs[rg][0]

    rg, _, _ = best_split(n, evaluate)
    return rg, *runs[rg]


def tail_sweep(models: list[str], n: int, steps: int) -> dict[str, Any]:
    """Fully-async over colocated sync at N GPUs as the response-length tail and cap grow
    (mean held at ASSUMED["response_mean"]): where the published 2.35-2.77x would come from."""
    rows = []
    for model in models:
        for cap in (8192, 16384, 32768):
            for alpha in (3.0, 1.5, 1.2, 1.0):
                inp, derived = inputs_for(model, n, alpha, cap=cap)
                opt_s = derived["optimizer_s_one_gpu"]
                colo = dataclasses.replace(inp, push_s=derived["push_s_colocated"],
                                           push_paused_s=derived["push_s_colocated"])
                base = _run(colo, Schedule("sync"), opt_s, n, n, steps)[0]
                sched = Schedule("fully_async", staleness_threshold=ASSUMED["staleness_threshold"],
                                 max_staleness=ASSUMED["max_staleness"], in_flight="abort", overlap_push=True)
                rg, fa, _ = _best(inp, sched, opt_s, n, steps)
                rows.append({"model": model, "response_cap": cap, "tail_alpha": alpha,
                             "p99_over_mean": round(_quantile(inp.lengths, 0.99) / ASSUMED["response_mean"], 1),
                             "sync_colocated_tokens_per_s": round(base), "fully_async_tokens_per_s": round(fa),
                             "fully_async_rollout_gpus": rg, "speedup": round(fa / base, 2)})
    return {"gpus": n, "what": "fully_async (best split) over sync_colocated, response mean "
                               f"{ASSUMED['response_mean']} tokens, cap and tail varied", "rows": rows}


def _quantile(d: LengthDist, q: float) -> float:
    """The q-quantile of the capped Pareto: min(cap, min_len * (1 - q)^(-1/alpha))."""
    return min(d.max_len, d.min_len * (1 - q) ** (-1 / d.alpha))


def best_split(total_gpus: int, evaluate: Callable[[int], float],
               candidates: list[int] | None = None) -> tuple[int, float, dict[int, float]]:
    """The rollout GPU count R (the other ``total_gpus - R`` train) that maximises
    ``evaluate(R)`` (trained tokens/s): ``candidates``, or a grid of N/8 and then N/16 either
    side of its best. Returns (R, its tokens/s, {R: tokens/s for every R tried})."""
    if total_gpus < 2:
        raise ValueError(f"a split needs at least 2 GPUs, got {total_gpus}")
    tried: dict[int, float] = {}

    def at(r: int) -> None:
        r = max(1, min(total_gpus - 1, r))
        if r not in tried:
            tried[r] = evaluate(r)

    for r in candidates or [round(total_gpus * f / 8) for f in range(1, 8)]:
        at(r)
    if candidates is None:
        best = max(tried, key=tried.__getitem__)
        for r in (best - max(1, total_gpus // 16), best + max(1, total_gpus // 16)):
            at(r)
    best = max(tried, key=tried.__getitem__)
    return best, tried[best], tried


def disaggregated(inp: Inputs, sched: Schedule, total_gpus: int, num_steps: int = 20,
                  seed: int = 0) -> Callable[[int], float]:
    """``evaluate`` for :func:`best_split`: R rollout and N - R trainer GPUs, no shared device."""
    def evaluate(r: int) -> float:
        split = dataclasses.replace(inp, num_rollout=r, num_trainer=total_gpus - r)
        return simulate(split, sched, num_steps=num_steps, seed=seed, warmup_steps=2).trained_tokens_per_s
    return evaluate


__all__ = ["scaling", "inputs_for", "tail_sweep", "best_split", "disaggregated"]
