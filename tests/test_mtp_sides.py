"""The trainer's MTP modules and the engine's drafts are one function of one set of weights.

Both sides implement the MTP spec (``docs/mtp.md``) on their own: the trainer as modules on
the Hugging Face model (``actors/backends/mtp.py``), the engine as a forward over its flat
weight store (``actors/engines/mtp_model.py``). Here the trainer's weights, after a step that
moved the modules away from their initialisation, are loaded into the engine's store, and every
module's logits of the two sides are compared on one sequence.
"""

from __future__ import annotations

import torch

from actors.backends.mtp import mtp_logits
from actors.backends.torch_backend import TorchBackend
from actors.engines.kv_cache import KVCache
from actors.engines.model import Model, ModelConfig
from actors.engines.mtp_model import DraftKVCache, module_forward, module_logits, prefill_hidden
from actors.engines.weights import WeightStore
from actors.models import BUILTIN_MODEL_DIR
from policies.losses import make_loss
from tests.helpers import samples_for

K = 2


def _trained_backend() -> TorchBackend:
    backend = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), mtp_layers=K, lr=1e-2,
                           mtp_loss_weight=1.0)
    backend.setup()
    samples = samples_for(21, num=4)
    for s in samples:
        s.rollout_logprobs = [-1.0] * len(s.response_ids)
    backend.train_step(samples, [1.0, -1.0, 0.5, -0.5])  # moves every module off the spec's init
    return backend


def _engine_logits(named: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    cfg = ModelConfig.from_dir(BUILTIN_MODEL_DIR)
    device, dtype = torch.device("cpu"), torch.float32
    store = WeightStore(cfg, device, dtype, mtp_layers=K)
    store.load_full({n: t.float() for n, t in named.items()})
    model = Model(cfg, 64, device, dtype)
    slots = torch.tensor([0])
    tokens = torch.tensor([ids])
    hidden = prefill_hidden(model, store, KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim, device,
                                                  dtype), tokens, slots)  # H0 [1, T, h]
    drafts = DraftKVCache(cfg, K, 1, 64, device, dtype)
    out = []
    for k in range(K):  # module k at column i reads token i + k + 1 and H_k[i]
        n = len(ids) - k - 1
        hidden = module_forward(model, store, drafts, k, tokens[:, k + 1 :], hidden[:, :n], None, None, slots)
        out.append(module_logits(model, store, k, hidden)[0])
    return out


def test_the_engines_draft_logits_equal_the_trainers_mtp_logits_on_trained_weights():
    backend = _trained_backend()
    named = backend.named_weights()
    assert {n for n in named if n.startswith("mtp.")}, "the trainer pushes no MTP weights"
    sample = max(samples_for(21, seed=3), key=lambda s: len(s.prompt_ids) + len(s.response_ids))
    ids = sample.prompt_ids + sample.response_ids
    trainer = mtp_logits(backend, ids)
    engine = _engine_logits(named, ids)
    for k in range(K):
        rows = len(ids) - k - 2  # row i predicts t[i + k + 2]
        torch.testing.assert_close(engine[k][:rows], trainer[k][:rows], atol=2e-4, rtol=1e-4)
    # and the step did move them: the spec's init would agree trivially only if it were untouched
    init = TorchBackend(str(BUILTIN_MODEL_DIR), loss=make_loss("ppo_clip"), mtp_layers=K)
    init.setup()
    assert (mtp_logits(init, ids)[0] - trainer[0]).abs().max() > 1e-3
