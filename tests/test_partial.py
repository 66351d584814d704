"""Resume budgets: one cumulative budget per response, whatever the number of resumes."""

from __future__ import annotations

import pytest

from contracts.rollout import GenerateOutput, SamplingParams
from policies.partial import absorb, next_request, remaining_budget
from contracts.sample import Sample


def _interrupted(req, num_tokens: int, version: int) -> GenerateOutput:
    n = min(num_tokens, req.max_tokens)
    return GenerateOutput(request_id=req.request_id, token_ids=[7] * n, logprobs=[-0.5] * n,
                          token_versions=[version] * n,
                          finish_reason="abort" if n < req.max_tokens else "length")


@pytest.mark.parametrize("num_interruptions", [1, 2, 5])
@pytest.mark.parametrize("prompt_len", [1, 3, 40])
def test_resume_never_exceeds_response_budget_and_grants_the_remainder(num_interruptions, prompt_len):
    max_response_tokens = 20
    sample = Sample(uid="u", group_id="g", prompt_ids=list(range(prompt_len)))
    sampling = SamplingParams()
    for i in range(num_interruptions):
        req = next_request(sample, max_response_tokens, sampling)
        assert req.max_tokens == max_response_tokens - len(sample.response_ids)
        assert req.prompt_ids == sample.prompt_ids + sample.response_ids
        done = absorb(sample, _interrupted(req, 3, version=i), max_response_tokens)
        assert not done
        sample.num_resumes += 1
    req = next_request(sample, max_response_tokens, sampling)
    assert req.max_tokens == max_response_tokens - 3 * num_interruptions
    assert absorb(sample, _interrupted(req, 10**6, version=num_interruptions), max_response_tokens)
    assert len(sample.response_ids) == max_response_tokens
    assert sample.finish_reason == "length"
    assert (sample.min_version, sample.max_version) == (0, num_interruptions)
    assert len(sample.token_versions) == len(sample.rollout_logprobs) == len(sample.response_ids)


def test_a_budget_spent_exactly_at_the_interruption_finishes_with_length():
    sample = Sample(uid="u", group_id="g", prompt_ids=[1])
    req = next_request(sample, 4, SamplingParams())
    out = GenerateOutput(request_id=req.request_id, token_ids=[2] * 4, logprobs=[0.0] * 4,
                         token_versions=[0] * 4, finish_reason="abort")
    assert absorb(sample, out, 4)
    assert sample.finish_reason == "length" and remaining_budget(sample, 4) == 0


def test_an_engine_that_overshoots_the_budget_is_an_error():
    sample = Sample(uid="u", group_id="g", prompt_ids=[1])
    out = GenerateOutput(request_id="x", token_ids=[2] * 5, logprobs=[0.0] * 5, token_versions=[0] * 5,
                         finish_reason="length")
    with pytest.raises(RuntimeError, match="budget"):
        absorb(sample, out, 4)
