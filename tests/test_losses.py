import math

import pytest
import torch

from policies.losses import decoupled_ppo, make_loss, ppo_clip, tis_seq, tis_token


def test_ppo_clip_matches_hand_computed_values():
    # rollout log-probs 0, so ratio = exp(logprobs). Ratios [[1.5, 0.5], [1.1, pad]], A = [+1, -1], eps 0.2.
    #   tok (0,0): r 1.5, A +1: min(1.5, 1.2) = 1.2 (clipped)  -> -1.2
    #   tok (0,1): r 0.5, A +1: min(0.5, 0.8) = 0.5            -> -0.5
    #   tok (1,0): r 1.1, A -1: min(-1.1, -1.1) = -1.1         -> +1.1
    # token mean = (-1.2 - 0.5 + 1.1) / 3 = -0.2; clip_frac 1/3; ratio_mean 3.1/3
    logprobs = torch.log(torch.tensor([[1.5, 0.5], [1.1, 9.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = ppo_clip(logprobs, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx(3.1 / 3, abs=1e-6)
    loss.backward()
    # d/dlogp of -r*A/3 is -r*A/3: clipped token 0, (0,1): -0.5/3, (1,0): +1.1/3, padding 0.
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.5 / 3], [1.1 / 3, 0.0]]), atol=1e-6)


def test_dual_clip_holds_a_negative_advantage_token_at_c_times_a_and_stops_its_gradient():
    # rollout log-probs 0: ratios [5, 2, 0.5], A = [-1, -1, +1] per token; c = 3, eps 0.2.
    #   tok 0: r 5, A -1: min(-5, -1.2) = -5 -> held at c * A = -3, no gradient
    #   tok 1: r 2, A -1: min(-2, -1.2) = -2 (above -3: as in plain PPO)
    #   tok 2: r 0.5, A +1: min(0.5, 0.8) = 0.5 (A > 0: untouched)
    logprobs = torch.log(torch.tensor([[5.0, 2.0, 0.5]])).requires_grad_()
    adv, mask = torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, m = ppo_clip(logprobs, torch.zeros(1, 3), adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 0.5) / 3, abs=1e-6)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 2.0 / 3, -0.5 / 3]]), atol=1e-6)
    plain, pm = ppo_clip(logprobs.detach(), torch.zeros(1, 3), adv, mask)
    assert plain.item() == pytest.approx((5.0 + 2.0 - 0.5) / 3, abs=1e-6) and "dual_clip_frac" not in pm
    # decoupled_ppo clips the proximal ratio the same way (behaviour = proximal: weights 1)
    dec, dm = decoupled_ppo(logprobs.detach(), torch.zeros(1, 3), adv, mask, proximal_logprobs=torch.zeros(1, 3),
                            clip_ratio_c=3.0)
    assert dec.item() == pytest.approx(loss.item(), abs=1e-6) and dm["dual_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c must be above 1"):
        ppo_clip(logprobs.detach(), torch.zeros(1, 3), adv, mask, clip_ratio_c=1.0)


def test_decoupled_ppo_matches_hand_computed_values():
    # proximal log-probs 0; behaviour probs [0.5, 0.1, 1.0] -> weights exp(0 - log b) = [2, 10 -> cap 5, 1].
    # current/proximal ratios [1.0, 1.5, 0.9], A = 2, eps 0.2:
    #   tok 0: min(2.0, 2.0) = 2.0   * 2 = 4.0
    #   tok 1: min(3.0, 2.4) = 2.4   * 5 = 12.0  (clipped, weight capped)
    #   tok 2: min(1.8, 1.8) = 1.8   * 1 = 1.8
    # truncate: loss = -(4 + 12 + 1.8) / 3 = -5.93333; mask mode drops tok 1: -(4 + 1.8) / 3 = -1.93333
    logprobs = torch.log(torch.tensor([[1.0, 1.5, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 1.0]]))
    kwargs = dict(proximal_logprobs=torch.zeros(1, 3), behav_weight_cap=5.0)
    mask = torch.ones(1, 3)
    loss, m = decoupled_ppo(logprobs, behaviour, torch.tensor([2.0]), mask, **kwargs)
    assert loss.item() == pytest.approx(-17.8 / 3, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["behav_capped_frac"] == pytest.approx(1 / 3)
    assert m["behav_weight_mean"] == pytest.approx(8 / 3, abs=1e-5)
    loss, _ = decoupled_ppo(logprobs, behaviour, torch.tensor([2.0]), mask, cap_mode="mask", **kwargs)
    assert loss.item() == pytest.approx(-5.8 / 3, abs=1e-5)


def test_decoupled_ppo_without_proximal_logprobs_is_an_error():
    with pytest.raises(ValueError, match="proximal_logprobs"):
        decoupled_ppo(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))


def test_tis_token_matches_hand_computed_values():
    # current probs [0.6, 0.9], behaviour [0.2, 0.9] -> ratios [3 -> cap 2, 1]; A = 1
    # loss = -(2 * log 0.6 + 1 * log 0.9) / 2 = (1.021651 + 0.105361) / 2 = 0.563506
    # gradient w.r.t. logprobs = -w * A / 2 = [-1.0, -0.5]
    logprobs = torch.log(torch.tensor([[0.6, 0.9]])).requires_grad_()
    loss, m = tis_token(logprobs, torch.log(torch.tensor([[0.2, 0.9]])), torch.tensor([1.0]), torch.ones(1, 2), cap=2.0)
    assert loss.item() == pytest.approx(-(2 * math.log(0.6) + math.log(0.9)) / 2, abs=1e-6)
    assert m["truncated_frac"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx(1.5)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -0.5]]), atol=1e-6)


def test_tis_seq_matches_hand_computed_values():
    # seq 0: probs [0.6, 0.9] vs behaviour [0.2, 0.9] -> ratio 3 -> cap 2; A = +1
    # seq 1: probs [0.5] vs behaviour [0.5] -> ratio 1; A = -1  (second token is padding)
    # loss = -(2 log 0.6 + 2 log 0.9 - log 0.5) / 3 = -(-1.021651 - 0.210721 + 0.693147) / 3 = 0.179742
    logprobs = torch.log(torch.tensor([[0.6, 0.9], [0.5, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.2, 0.9], [0.5, 0.7]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = tis_seq(logprobs, behaviour, torch.tensor([1.0, -1.0]), mask, cap=2.0)
    assert loss.item() == pytest.approx(-(2 * math.log(0.6) + 2 * math.log(0.9) - math.log(0.5)) / 3, abs=1e-6)
    assert m["is_weight_mean"] == pytest.approx(1.5, abs=1e-6)
    assert m["truncated_frac"] == pytest.approx(0.5)


def test_every_loss_is_zero_on_an_all_padding_batch():
    for name in ("ppo_clip", "decoupled_ppo", "tis_token", "tis_seq"):
        loss, _ = make_loss(name)(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), proximal_logprobs=torch.zeros(2, 3)
        )
        assert loss.item() == 0.0


def test_unknown_loss_name_is_named_in_the_error():
    with pytest.raises(ValueError, match="'ppo_clipp'"):
        make_loss("ppo_clipp")


def test_a_loss_binds_its_options_and_pickles_by_reference():
    import pickle

    loss = make_loss("decoupled_ppo", clip_eps_low=0.1, behav_weight_cap=3.0)
    assert loss.needs_proximal and not make_loss("ppo_clip").needs_proximal
    data = pickle.dumps(loss)
    assert b"policies.losses" in data and len(data) < 400  # the function by name, no code
    again = pickle.loads(data)
    assert again == loss and again.fn is decoupled_ppo
    args = torch.log(torch.tensor([[0.5, 0.4]])), torch.log(torch.tensor([[0.4, 0.4]])), torch.ones(1), torch.ones(1, 2)
    got, _ = again(*args, proximal_logprobs=args[0])
    want, _ = decoupled_ppo(*args, proximal_logprobs=args[0], clip_eps_low=0.1, behav_weight_cap=3.0)
    assert got.item() == want.item()


def test_an_option_the_loss_does_not_take_is_named():
    with pytest.raises(ValueError, match=r"loss 'ppo_clip' has no option\(s\) \['clip_eps'\]"):
        make_loss("ppo_clip", clip_eps=0.2)


def test_the_trainer_section_maps_onto_loss_options():
    from types import SimpleNamespace

    from policies.losses import make_loss_from_config

    section = SimpleNamespace(loss="ppo_clip", clip_eps=0.1, is_cap=4.0, is_cap_mode="truncate", clip_ratio_c=None)
    assert make_loss_from_config(section) == make_loss("ppo_clip", clip_eps_low=0.1, clip_eps_high=0.1)
    section.loss = "decoupled_ppo"
    assert make_loss_from_config(section).options == {"clip_eps_low": 0.1, "clip_eps_high": 0.1, "behav_weight_cap": 4.0}
    section.clip_ratio_c, section.is_cap_mode = 3.0, "mask"
    assert make_loss_from_config(section).options == {"clip_eps_low": 0.1, "clip_eps_high": 0.1, "behav_weight_cap": 4.0,
                                                      "cap_mode": "mask", "clip_ratio_c": 3.0}
    section.loss = "tis_seq"
    assert make_loss_from_config(section) == make_loss("tis_seq", cap=4.0)


def test_dual_clip_and_cap_mode_in_config_reach_the_loss_and_a_bad_value_is_one_line():
    from actors.config import ConfigError, load_config
    from policies.losses import make_loss_from_config

    cfg = load_config(None, ["trainer.loss=decoupled_ppo", "trainer.clip_ratio_c=3", "trainer.is_cap_mode=mask"])
    options = make_loss_from_config(cfg.trainer).options
    assert options["clip_ratio_c"] == 3.0 and options["cap_mode"] == "mask"
    with pytest.raises(ConfigError, match="trainer.is_cap_mode: must be truncate with loss 'ppo_clip'"):
        load_config(None, ["trainer.is_cap_mode=mask"])
    for bad in (["trainer.clip_ratio_c=1"], ["trainer.loss=tis_token", "trainer.clip_ratio_c=3"]):
        with pytest.raises(ConfigError, match="trainer.clip_ratio_c: must be null or above 1") as err:
            load_config(None, bad)
        assert "\n" not in str(err.value).strip()
