"""A reward function written for verl (``custom_reward_function``), used here as it is.

verl calls ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)`` for each response; asyncrl reads the same parameter names and
passes the same things: the row's ``data_source`` and ``extra_info`` columns,
the decoded response, and the answer field (``reward_model.ground_truth``).
Nothing here imports asyncrl.
"""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_solution(solution_str):
    """The answer after the last '####', else the last number in the text (verl's gsm8k 'flexible')."""
    if "####" in solution_str:
        solution_str = solution_str.rsplit("####", 1)[1]
    numbers = _NUMBER.findall(solution_str)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_solution(solution_str)
    if answer is None:
        return {"score": 0.0, "has_answer": False}
    return {"score": 1.0 if answer == ground_truth else 0.0, "has_answer": True}
