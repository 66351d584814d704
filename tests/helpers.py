"""Plain helpers that several test modules share (fixtures live in tests/conftest.py).

No test module imports another test module: what two of them need is here. Heavy
packages (torch, transformers, tokenizers) are imported inside the helpers that
use them, so a module that takes a queue helper does not pay for them.

    loopback          free_port, silent_listener
    TransferQueue     make_samples, assert_accounting, with_arrays,
                      check_array_samples_round_trip, run_producers_consumers
    text tasks        CHATML, build_byte_tokenizer
    tiny HF models    hf_config, hf_model, save_model, samples_for (Megatron's maps and backend)
    real runs         train_checking_engine_weights
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pytest

from contracts.sample import Sample
from transfer_queue import EndOfStream, TransferQueue
from transfer_queue.wire import QueueStats

if TYPE_CHECKING:
    import pathlib

    import torch
    import transformers


# ----------------------------------------------------------------------- loopback
def free_port() -> int:
    """A loopback port nothing listens on (bound a moment ago, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def silent_listener() -> socket.socket:
    """A loopback port that accepts TCP connections (the kernel completes them) and
    never answers: the test's own socket, never read from."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


# ------------------------------------------------------------------ TransferQueue
def make_samples(
    num_groups: int, group_size: int = 1, version: int = 0, prefix: str = "s", num_tokens: int = 4
) -> list[Sample]:
    """``num_groups`` GRPO groups of ``group_size`` samples, every token from ``version``."""
    out = []
    for g in range(num_groups):
        for k in range(group_size):
            i = g * group_size + k
            out.append(
                Sample(
                    uid=f"{prefix}{i}",
                    group_id=f"{prefix}g{g}",
                    prompt_ids=[1, 2, 3],
                    response_ids=list(range(i, i + num_tokens)),
                    rollout_logprobs=[-0.5] * num_tokens,
                    token_versions=[version] * num_tokens,
                    reward=float(k),
                    finish_reason="stop",
                    meta={"answer": str(i)},
                )
            )
    return out


def assert_accounting(stats: QueueStats) -> None:
    assert stats.dropped == sum(stats.dropped_by_reason.values())
    assert stats.put == stats.delivered + stats.dropped + stats.pending + stats.in_flight, stats


def with_arrays(samples: list[Sample]) -> list[Sample]:
    """The same samples holding numpy arrays as an engine hands them over (int64 ids,
    float64 log-probs: the queue stores int32 and float32)."""
    return [
        msgspec.structs.replace(
            s, prompt_ids=np.array(s.prompt_ids, np.int64), response_ids=np.array(s.response_ids, np.int64),
            rollout_logprobs=np.array(s.rollout_logprobs, np.float64), token_versions=np.array(s.token_versions, np.int64),
        )
        for s in samples
    ]  # fmt: skip


async def check_array_samples_round_trip(tq: TransferQueue) -> None:
    """Array samples come back as read-only arrays (int32 / float32) with their values, next to
    list samples in the same batch, with version tags from the arrays; bad arrays are refused."""
    lists = make_samples(2, 2, version=3)
    arrays = with_arrays(make_samples(2, 2, version=3, prefix="a", num_tokens=1000))
    arrays[0].response_ids[0] = 2**31 - 1  # the largest token id int32 holds
    await tq.put(lists[:2])
    await tq.put(arrays[:2])
    await tq.put(arrays[2:])
    await tq.put(lists[2:])
    batch = await tq.get("trainer", 8, sampler="grpo_group", group_size=2, current_version=4, max_staleness=1)
    assert batch.dropped == {}  # tags (min/max version) came from the arrays
    got = {s.uid: s for s in batch.samples}
    for want in arrays:
        s = got[want.uid]
        assert s.response_ids.dtype == np.int32 and s.rollout_logprobs.dtype == np.float32
        assert s.response_ids.tolist() == want.response_ids.tolist()
        assert s.rollout_logprobs.tolist() == want.rollout_logprobs.astype(np.float32).tolist()
        assert (s.min_version, s.max_version) == (3, 3) and s.reward == want.reward
        with pytest.raises(ValueError, match="read-only"):
            s.response_ids[0] = 0  # a redelivery must see what was put
    for want in lists:
        assert got[want.uid] == want
    columns = dict(zip(batch.uids, batch.column("response_ids")))
    assert all(columns[s.uid].tolist() == list(s.response_ids) for s in (*lists, *arrays))
    await tq.ack(batch.batch_id)
    bad = make_samples(1, prefix="bad")
    bad[0].response_ids = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match="'response_ids' must be a list or a 1-D array"):
        await tq.put(bad)
    assert_accounting(await tq.statistics_async())


async def run_producers_consumers(
    tq: TransferQueue, num_producers: int = 4, num_consumers: int = 2, per_producer: int = 64, batch_size: int = 8
) -> None:
    """4 producers x 2 consumers; every uid put is delivered exactly once or dropped with a reason."""
    delivered: list[str] = []
    received = [0]

    async def produce(p: int) -> None:
        samples = make_samples(per_producer // 4, 4, prefix=f"p{p}-")
        for i in range(0, len(samples), 4):
            await tq.put(samples[i : i + 4])

    async def consume(c: int) -> None:
        while True:
            try:
                batch = await tq.get(f"trainer-{c}", batch_size, sampler="grpo_group", group_size=4)
            except EndOfStream:
                return
            received[0] += 1
            if received[0] % 3 == 0:
                await tq.nack(batch.batch_id)  # exercise redelivery under load
            else:
                delivered.extend(s.uid for s in batch.samples)
                await tq.ack(batch.batch_id)

    consumers = [asyncio.create_task(consume(c)) for c in range(num_consumers)]
    await asyncio.gather(*(produce(p) for p in range(num_producers)))
    await tq.drop([], "unused")  # a no-op drop is allowed
    await tq.close()
    await asyncio.gather(*consumers)
    stats = await tq.statistics_async()
    assert_accounting(stats)
    assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
    assert stats.put == num_producers * per_producer
    assert stats.delivered == len(delivered) == stats.put - stats.dropped - stats.pending
    assert stats.pending == 0 and stats.in_flight == 0


# --------------------------------------------------------------------- text tasks
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_byte_tokenizer(chat_template: str | None = CHATML):
    """A byte-level tokenizer (256 byte tokens, no merges: any text round-trips)
    with ``<|endoftext|>`` as eos and ChatML turn markers as special tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template:
        tok.chat_template = chat_template
    return tok


# ----------------------------------------------------------------- tiny HF models
def hf_config(kind: str, **over) -> transformers.PretrainedConfig:
    """A tiny GQA model (4 query heads, 2 key/value heads): Qwen2 with qkv biases and a
    tied head, or Llama with its own lm_head. The vocabulary (37) is odd, so TP 2 pads it;
    initializer_range 0.2 keeps the logits far from uniform."""
    import transformers

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=37, max_position_embeddings=64,
                  rms_norm_eps=1e-6, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, "rope_theta": 1e6, **over})
    assert kind == "llama"
    return transformers.LlamaConfig(**{**common, "tie_word_embeddings": False, "rope_theta": 5e5, **over})


def hf_model(kind: str, seed: int = 0, **over) -> transformers.PreTrainedModel:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **over))
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a layout slip shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def save_model(kind: str, path: pathlib.Path, dtype: torch.dtype | None = None) -> pathlib.Path:
    """``hf_model(kind)`` saved to ``path`` in ``dtype`` (float32 when None)."""
    import torch

    hf_model(kind).to(dtype or torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def llama_dirs(root: pathlib.Path) -> dict[str, str]:
    """The tiny Llama (its own lm_head) saved under ``root`` in fp32 and in bf16, by dtype name."""
    import torch

    return {"float32": str(save_model("llama", root / "fp32")),
            "bfloat16": str(save_model("llama", root / "bf16", dtype=torch.bfloat16))}


def samples_for(vocab: int, seed: int = 0, num: int = 6) -> list[Sample]:
    """Three groups of two responses, prompts and responses of different lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        p, n = 3 + (i * 5) % 9, 2 + (i * 3) % 7
        ids = torch.randint(3, vocab, (p + n,), generator=g).tolist()
        out.append(Sample(uid=f"s{i}", group_id=f"g{i // 2}", prompt_ids=[1, *ids[:p]], response_ids=ids[p:]))
    return out


# ---------------------------------------------------------------------- real runs
def train_checking_engine_weights(run, steps: int, dtype: str = "bfloat16") -> None:
    """Train step by step; after each sync every engine holds the trainer's version, bit for bit."""
    import loop

    policy = run.policy
    for step in range(1, steps + 1):
        (m,) = run.train(steps=1)
        assert m["sync/version"] == step
        want = loop.run(policy.trainer.weights_digest(dtype))
        for rollout in policy.rollouts:
            assert loop.run(rollout.get_version()) == step
            assert loop.run(rollout.weights_digest()) == want


def force_codec_path(monkeypatch: pytest.MonkeyPatch, path: str, min_part: int) -> None:
    """Make ``sync.codec.choose`` pick ``path`` on a CPU: ``c`` (the native kernels
    on a 2-thread pool, parts of at least ``min_part`` elements; skipped without a
    C compiler) or ``torch`` (the native library disabled)."""
    from sync import codec, native, pool

    if path == "c":
        if not native.available():
            pytest.skip("no C compiler")
        monkeypatch.setattr(pool, "NUM_THREADS", 2)
        monkeypatch.setattr(pool, "MIN_PART", min_part)
    else:
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_lib_error", "disabled for this test")
    assert codec.choose("cpu", 2) == path


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs on the CPU)")


def run_in_triton_interpreter(code: str) -> None:
    """Run ``code`` in a new Python with TRITON_INTERPRET=1 (set before any triton.jit runs,
    hence a process of its own), from the repository root; fail with its stderr."""
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
