"""Tools apart from the library: scripts run from a checkout, never imported
by the runtime.

    python -m tools.warmstart --out actors/assets/tiny-qwen2 ...   # build the built-in tiny model
    python -m tools.rl_smoke --steps 400 --seed 0                    # synchronous GRPO yardstick
"""
