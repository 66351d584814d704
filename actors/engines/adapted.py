"""What the adapters of external engines (``vllm_engine``, ``sglang_engine``) share."""

from __future__ import annotations

import asyncio

from contracts.rollout import GenerateOutput


def copy_output(out: GenerateOutput) -> GenerateOutput:
    """A copy of ``out`` whose lists the adapter's stream can go on filling."""
    return GenerateOutput(request_id=out.request_id, token_ids=list(out.token_ids), logprobs=list(out.logprobs),
                          raw_logprobs=list(out.raw_logprobs), token_versions=list(out.token_versions),
                          finish_reason=out.finish_reason)


async def first_of(*events: asyncio.Event) -> None:
    """Return when any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
