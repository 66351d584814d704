"""Benchmarks: each prints one JSON object (``emit``), comparing its contenders in one run."""

from __future__ import annotations

import json
from typing import Any


def emit(result: Any, out: str | None, indent: int | None = None) -> None:
    """Print ``result`` as one JSON object; also write it to ``out`` (a path) when given."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
