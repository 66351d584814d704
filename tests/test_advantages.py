import pytest
import torch

from policies.advantages import grpo_advantages


def test_std_scaled_advantages_match_hand_computed_values():
    # Group 0: rewards 1, 0, 0.5 -> mean 0.5, population std sqrt((0.25+0.25+0)/3) = 0.408248
    #   -> (0.5, -0.5, 0) / 0.408248 = (1.224745, -1.224745, 0)
    # Group 5: rewards 0.2, 0.6 -> mean 0.4, std 0.2 -> (-1, 1)
    rewards = torch.tensor([1.0, 0.2, 0.0, 0.6, 0.5])
    groups = torch.tensor([0, 5, 0, 5, 0])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.224745, -1.0, -1.224745, 1.0, 0.0]), atol=1e-5)


def test_unscaled_advantages_are_reward_minus_group_mean():
    # Group 0 mean 0.5 -> (0.5, -0.5); group 1 mean 0.4 -> (-0.2, 0.2)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.2, 0.6]), torch.tensor([0, 0, 1, 1]), scale="none")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.2, 0.2]), atol=1e-6)


def test_a_group_with_equal_rewards_gets_zero_advantage():
    adv = grpo_advantages(torch.tensor([0.7, 0.7, 0.7]), torch.tensor([3, 3, 3]))
    assert torch.equal(adv, torch.zeros(3))


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(torch.tensor([1.0]), torch.tensor([0]), scale="max")
