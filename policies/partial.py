"""Partial rollouts: one cumulative token budget per response, across resumes.

A generation interrupted by a weight sync keeps its tokens, log-probs and the
versions that produced them; it resumes on the new weights from
``prompt + partial response`` with only what is left of its budget. The
prompt's own length never counts against the response budget.
"""

from __future__ import annotations

from contracts.rollout import GenerateOutput, GenerateRequest, SamplingParams
from contracts.sample import Sample

__all__ = ["remaining_budget", "next_request", "absorb"]


def remaining_budget(sample: Sample, max_response_tokens: int) -> int:
    """New tokens the sample may still generate (0 when its budget is spent)."""
    return max(0, max_response_tokens - len(sample.response_ids))


def next_request(sample: Sample, max_response_tokens: int, sampling: SamplingParams) -> GenerateRequest:
    """The engine request that continues ``sample`` where it stopped."""
    budget = remaining_budget(sample, max_response_tokens)
    assert budget > 0, "a sample with no budget left must finish with 'length'"
    return GenerateRequest(
        request_id=f"{sample.uid}/{sample.num_resumes}",
        prompt_ids=sample.prompt_ids + sample.response_ids,
        max_tokens=budget,
        sampling=sampling,
    )


def absorb(sample: Sample, out: GenerateOutput, max_response_tokens: int) -> bool:
    """Append one engine call's output to ``sample``. Returns True when the
    sample is finished (stop, length, or budget spent), False when it was
    interrupted and may resume."""
    room = remaining_budget(sample, max_response_tokens)
    if len(out.token_ids) > room:  # an engine that overshoots must not break the budget
        raise RuntimeError(
            f"engine returned {len(out.token_ids)} tokens for a budget of {room} ({out.request_id})"
        )
    sample.response_ids.extend(out.token_ids)
    sample.rollout_logprobs.extend(out.logprobs)
    sample.token_versions.extend(out.token_versions)
    if out.finish_reason == "abort":
        if remaining_budget(sample, max_response_tokens) == 0:
            sample.finish_reason = "length"
            return True
        return False
    sample.finish_reason = out.finish_reason or "length"
    return True
