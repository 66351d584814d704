"""Write arithmetic problems as verl-format Parquet files (no downloads).

    python examples/make_verl_parquet.py            # -> examples/verl_arithmetic_{train,eval}.parquet

The rows look like those verl's data preprocessing scripts write (e.g. its
gsm8k.py): ``data_source``, ``prompt`` as chat messages, ``ability``,
``reward_model`` with the ``ground_truth``, and ``extra_info``. The problems
are those of the ``text_arithmetic`` task (``policies.datasets.ArithmeticProblems``):
training draws from ``random.Random(0)``, and the first problems of its held-out
split for eval. Needs pyarrow (``pip install -e ".[parquet]"``).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from policies.datasets import ArithmeticProblems, Row  # noqa: E402

INSTRUCTION = "Answer with the number only."


def verl_record(row: Row, split: str, index: int) -> dict:
    """One row in verl's format."""
    return {"data_source": "asyncrl/arithmetic", "prompt": [{"role": "user", "content": row.prompt}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": row.answer},
            "extra_info": {"split": split, "index": index}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "examples"), help="directory to write the two files to")
    parser.add_argument("--num-train", type=int, default=32)
    parser.add_argument("--num-eval", type=int, default=8)
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = ArithmeticProblems(ops="+", instruction=INSTRUCTION)
    rng = random.Random(0)
    splits = {"train": [problems.sample(rng) for _ in range(args.num_train)],
              "eval": problems.held_out(args.num_eval)}
    for split, rows in splits.items():
        path = pathlib.Path(args.out) / f"verl_arithmetic_{split}.parquet"
        pq.write_table(pa.Table.from_pylist([verl_record(r, split, i) for i, r in enumerate(rows)]), path)
        print(f"wrote {path} ({len(rows)} rows, {path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
