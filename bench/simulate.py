"""``python -m bench.simulate``: a throughput model of the schedules, fed with measured costs.

    --validate            one JSON object: every kept H100 and H200 async_vs_sync run it can
                          forecast (bench.simulate_validate), predicted from standalone figures
                          and the kept interference model, beside the naive predictor's
    --calibrate           refit the interference model on its calibration runs and keep it
                          (bench/results/simulate/simulate_interference.json)
    --forecast, --levers  what-ifs on kept runs from their own in-loop clocks (bench.simulate_whatif)
    --model 0.5b,7b --gpus 8,32,128
                          one JSON object: predictions per schedule at those sizes, the best
                          rollout/trainer split, the inputs assumed (bench.simulate_scaling)

The model itself (events, schedules, admission, in-flight modes, evaluations, interference)
is ``bench.simulate_model``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from bench import simulate_scaling, simulate_validate, simulate_whatif


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return (f"{platform.machine()} VM, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"load {tuple(round(x, 2) for x in load) if load else 'n/a'} (the simulation itself; no GPU)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", action="store_true",
                    help="kept runs forecast from standalone figures and the kept interference model")
    ap.add_argument("--calibrate", action="store_true",
                    help=f"refit the interference model and write {simulate_validate.INTERFERENCE_FILE.name}")
    ap.add_argument("--forecast", action="store_true",
                    help="the kept SmolLM2 runs re-scheduled with evaluations beside training (a prediction)")
    ap.add_argument("--levers", action="store_true",
                    help="the H100 graphed-trainer run with each limit of fully-async taken away (a prediction)")
    ap.add_argument("--model", default="0.5b,7b", help="model sizes for scaling predictions: 0.5b, 7b")
    ap.add_argument("--gpus", default="8,32,128", help="total GPU counts, comma-separated")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.validate:
        result = simulate_validate.validate(_machine())
    elif args.calibrate:
        result = simulate_validate.calibrate()
        simulate_validate.INTERFERENCE_FILE.write_text(json.dumps(result, indent=1) + "\n")
    elif args.forecast:
        result = simulate_whatif.forecast(_machine())
    elif args.levers:
        result = simulate_whatif.levers(_machine())
    else:
        models = [m.strip().lower() for m in args.model.split(",") if m.strip()]
        try:
            gpus = [int(g) for g in args.gpus.split(",") if g]
            result = simulate_scaling.scaling(models, gpus, _machine())
        except ValueError as e:
            ap.error(str(e))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
