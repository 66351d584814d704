"""Speculative decoding with the MTP modules (``rollout.engine.speculative: mtp``):
the decode turns of the torch engine run one speculative step instead of one
decode step, and each running request advances by 1 to K + 1 tokens.

    request at p (its newest token t_p, not yet in the KV cache)
      draft:  module k over positions p-2K .. p-1, k = 0..K-1   -> d_1 .. d_K   (module KV rewritten there)
      verify: full model on [t_p, d_1 .. d_K] at p .. p+K       -> p_1 .. p_{K+1}, H0 (KV written)
      accept: exact speculative sampling (spec_sampling.py)     -> d_1 .. d_a, then one more token
      keep:   the last 2K H0 (positions p'-2K .. p'-1) for the next draft; stop / length cut the run

Drafting rewrites each module's last 2K positions every step: module k at
position i reads token ``i + k + 1``, which is a draft (not yet verified) for the
last k positions, so those entries are redone once the tokens are known. The
prefill fills the modules' KV over the prompt the same way (its tail is redone
by the first draft). The draft state lives in the engine's KV cache object
(:class:`~actors.engines.mtp_model.DraftKVCache`): compaction moves it, ``sleep``
frees it, and a preempted request's prefill rebuilds it with the main KV.

Steps are eager and read back at once (no overlap, no CUDA graphs). The tokens a
step emits go into the request's :class:`~actors.engines.engine_steps.Seq` at
once (its table column holds only its prefill token, taken in at its first step),
so rows that advance by different counts need no common column.
"""

from __future__ import annotations

import time

import torch

from actors.engines.engine_steps import Event, Scheduler, Seq
from actors.engines.mtp_model import DraftKVCache, extend, module_forward, module_logits, prefill_hidden
from actors.engines.sampling import SamplingBatch, log_probs
from actors.engines.spec_sampling import DRAFT, SpecResult, draw, speculative_sample

__all__ = ["SpeculativeScheduler"]


class SpeculativeScheduler(Scheduler):
    """:class:`Scheduler` whose decode turns run speculative steps when the engine's
    options ask for them (``EngineOptions.speculative``); otherwise it is the plain one."""

    kv: DraftKVCache  # type: ignore[assignment]  # with speculation on

    # ---- prefill: the modules' KV and the hidden tail too ----------------------------------
    def _prefill_logits(self, tokens: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        if not self.opts.speculative:
            return super()._prefill_logits(tokens, slots, last)
        with torch.inference_mode():
            h0 = prefill_hidden(self.model, self.weights, self.kv, tokens, slots)  # [B, T, h]
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            logits = torch.nn.functional.linear(h0[rows, last], self.weights.lm_head)
            hidden = h0
            for k in range(self.kv.num_modules):  # token i + k + 1 at column i (the tail is redrafted)
                shifted = torch.cat([tokens[:, k + 1:], tokens.new_zeros(tokens.shape[0], k + 1)], dim=1)
                shifted = shifted[:, : tokens.shape[1]]
                hidden = module_forward(self.model, self.weights, self.kv, k, shifted, hidden, None, None, slots)
            W = self.kv.window
            at = last[:, None] - W + 1 + torch.arange(W, device=tokens.device)  # positions p-2K .. p-1
            tail = h0[rows[:, None], at.clamp(min=0)]
            self.kv.hidden[slots] = torch.where((at >= 0)[..., None], tail, torch.zeros_like(tail))
        return logits

    # ---- a decode turn ------------------------------------------------------------------
    def _decode(self, events: list[Event]) -> None:
        if not self.opts.speculative:
            return super()._decode(events)
        t0 = time.perf_counter()
        self._compact()
        seqs = self.running
        if not seqs:
            return
        self._take_in_first_tokens(seqs)
        K, W, device = self.kv.num_modules, self.kv.window, self.opts.device
        p = [len(s.tokens) - 1 for s in seqs]
        window = [[0] * max(0, W - 1 - q) + s.tokens[max(0, q - W + 1): q + 1] for s, q in zip(seqs, p)]
        host = torch.tensor([w + [q] for w, q in zip(window, p)], dtype=torch.int64)
        host = host.to(device, non_blocking=True)
        tokens, position = host[:, :W], host[:, W]  # tokens at p-2K+1 .. p; p
        params = self._batch_for(seqs).params
        t1 = time.perf_counter()
        with torch.inference_mode():
            drafts, draft_lp = self._draft(tokens, position, params)
            verify = torch.cat([tokens[:, -1:], drafts], dim=1)
            at = position[:, None] + torch.arange(K + 1, device=device)
            h0, logits = extend(self.model, self.weights, self.kv, verify, at, at < self.kv.max_len)
            t2 = time.perf_counter()
            out = speculative_sample(logits, drafts, draft_lp, params, position)
            self._keep_tail(h0, out.num_accepted + 1)
        t3 = time.perf_counter()
        self._emit(seqs, p, out, events)
        self._compact()
        timing = self.timing
        timing["num_spec_steps"] += 1
        timing["forward_s"] += t2 - t1
        timing["sample_s"] += t3 - t2
        timing["decode_launch_s"] += t3 - t0

    def _take_in_first_tokens(self, seqs: list[Seq]) -> None:
        """Move each newcomer's prefill token from its table column into its :class:`Seq`
        (later tokens go there directly): from now on its table holds nothing."""
        num_steps = self.table.num_steps
        for s in seqs:
            if s.first != num_steps:
                slot = s.slot
                self._take_in(s)
                s.slot, s.first = slot, num_steps

    def _draft(self, tokens: torch.Tensor, position: torch.Tensor,
               params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """K drafts [B, K] and the log-probs [B, K, V] they were drawn from: module k runs
        over positions p-2K .. p-1 (tokens: the known ones, then the drafts so far)."""
        K, W = self.kv.num_modules, self.kv.window
        at = position[:, None] - W + torch.arange(W, device=position.device)  # p-2K .. p-1
        valid = at >= 0
        hidden = self.kv.hidden[: tokens.shape[0]]
        drafts: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        for k in range(K):
            inputs = torch.cat([tokens, *(d[:, None] for d in drafts)], dim=1)[:, k: k + W]
            hidden = module_forward(self.model, self.weights, self.kv, k, inputs, hidden, at, valid)
            raw, lp = log_probs(module_logits(self.model, self.weights, k, hidden[:, -1]), params)
            drafts.append(draw(raw, lp, params, position + 1 + k, DRAFT))
            lps.append(lp)
        return torch.stack(drafts, dim=1), torch.stack(lps, dim=1)

    def _keep_tail(self, h0: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """H0 of positions p'-2K .. p'-1 (p' = p + emitted) into each row's tail: from the
        old tail (p-2K .. p-1) followed by the verified positions (p .. p+K)."""
        B, W = h0.shape[0], self.kv.window
        both = torch.cat([self.kv.hidden[:B], h0], dim=1)  # positions p-2K .. p+K
        index = (num_emitted[:, None] + torch.arange(W, device=h0.device))[..., None].expand(B, W, h0.shape[-1])
        self.kv.hidden[:B] = both.gather(1, index)

    def _emit(self, seqs: list[Seq], p: list[int], out: SpecResult, events: list[Event]) -> None:
        """Each row's tokens of this step into its :class:`Seq`, cut at its first stop token
        (kept) or its last position; streamed rows get them now, ended rows end."""
        K = self.kv.num_modules
        dtype = self._readback_dtype
        host = torch.stack([out.tokens.to(dtype), out.logprobs.to(dtype), out.raw_logprobs.to(dtype)])
        values, accepted = host.tolist(), out.num_accepted.tolist()
        version, timing = self.version, self.timing
        num_emitted = 0
        for i, s in enumerate(seqs):
            room = s.last_pos - p[i]  # tokens it may still sample (>= 1)
            n = min(accepted[i] + 1, room)
            tokens = [int(x) for x in values[0][i][:n]]
            finish = "length" if n == room else None
            stops = s.sampling.stop_token_ids
            if stops:
                cut = next((j for j, x in enumerate(tokens) if x in stops), None)
                if cut is not None:
                    n, tokens, finish = cut + 1, tokens[: cut + 1], "stop"
            lps, raws = values[1][i][:n], values[2][i][:n]
            s.tokens += tokens
            s.logprobs += lps
            s.raw_logprobs += raws
            num_emitted += n
            timing["num_draft_tokens"] += min(K, room)
            timing["num_accepted_draft_tokens"] += min(accepted[i], room)
            if s.streamed:
                events.append((s.stream, tokens, lps, raws, [version] * n, finish, None))
            if finish is not None:
                self._end_running(s, finish)
                if not s.streamed:
                    events.append(self._end(s, finish))
        self.num_generated_tokens += num_emitted
