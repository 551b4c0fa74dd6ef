"""Check the PPO tricks in common/ppo_tricks.py against plain-Python references and their defining formulas, and
ppo_ray.py's advantage estimators on top of them."""

import ast
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch

import ppo_ray
from common import ppo_tricks
from common.args import UserError
from common.ppo_tricks import (AdaptiveKLController, FixedKLController, aggregate, compute_gae, compute_returns,
                               compute_token_rewards, group_advantages, groups_with_a_spread, kl_penalty, masked_mean,
                               masked_var, masked_whiten, overlong_penalty, place_reward_on_eos)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- fixtures
def right_padded_mask(lengths: list[int], seq: int) -> torch.Tensor:
    """Each row's response starts at position 0 and runs for its length, then padding."""
    return torch.tensor([[t < n for t in range(seq)] for n in lengths])  # (batch, seq)


def left_padded_mask(starts: list[int], lengths: list[int], seq: int) -> torch.Tensor:
    """Each row's response starts after its (left-padded) prompt and runs for its length, then padding."""
    return torch.tensor([[s <= t < s + n for t in range(seq)] for s, n in zip(starts, lengths)])  # (batch, seq)


def reference_gae(rewards, values, mask, gamma, lam):
    """GAE as a reverse loop over each row's masked positions alone, as if the others were not there."""
    batch, seq = len(mask), len(mask[0])
    advantages = [[0.0] * seq for _ in range(batch)]
    for b in range(batch):
        steps = [t for t in range(seq) if mask[b][t]]
        next_advantage = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = values[b][steps[i + 1]] if i + 1 < len(steps) else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[b][t] = next_advantage
    return torch.tensor(advantages, dtype=torch.float64)


MASKS = {
    "right_padded": right_padded_mask([7, 3, 1, 5, 0], seq=7),
    "left_padded": left_padded_mask(starts=[0, 2, 4, 6, 1], lengths=[5, 4, 3, 1, 6], seq=8),
    # multi-turn episodes: the environment's tokens (0) between the policy's turns (1)
    "multi_turn": torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [0, 1, 0, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1]]).bool(),
}


# ----------------------------------------------------------------------------------------------- GAE and returns
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_compute_gae_matches_reverse_loop(mask_kind, gamma, lam):
    mask = MASKS[mask_kind]
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    expected = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)

    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)

    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.where(mask, expected + values, 0.0))
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_a_multi_turn_episode_credits_every_turn_with_the_final_reward():
    """Reward 1 at the end of the second turn, gamma = lam = 1, V = 0: the first turn's tokens, before the
    environment's reply, get advantage 1 too. (Ending the episode at the gap would have given them 0.)"""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]]).bool()
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 1, 0]])
    advantages, _ = compute_gae(rewards, torch.zeros(1, 7), mask, 1.0, 1.0)
    assert advantages.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]]
    # with values, the first turn's last token looks ahead to the second turn's first: delta = 0 + V(4) - V(1)
    values = torch.tensor([[0.0, 0.25, 9.0, 9.0, 0.5, 0.75, 9.0]])
    advantages, _ = compute_gae(rewards, values, mask, 1.0, 0.0)
    assert advantages.tolist() == [[0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0]]


def test_compute_gae_ignores_masked_out_values_and_rewards():
    mask = MASKS["left_padded"]
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, *mask.shape, generator=gen)
    advantages, returns = compute_gae(rewards, values, mask, 0.99, 0.95)

    garbage = torch.full(mask.shape, float("nan"))
    advantages2, returns2 = compute_gae(
        torch.where(mask, rewards, garbage), torch.where(mask, values, garbage), mask, 0.99, 0.95
    )
    torch.testing.assert_close(advantages2, advantages)
    torch.testing.assert_close(returns2, returns)


def test_compute_gae_lambda_one_is_return_minus_value():
    # With lam=1 the deltas telescope: A_t = sum of discounted rewards from t on - V(s_t) (GAE eq. 18).
    mask = MASKS["right_padded"]
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(2, *mask.shape, generator=gen, dtype=torch.float64)
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.9, lam=1.0)
    torch.testing.assert_close(advantages, torch.where(mask, compute_returns(rewards, mask, 0.9) - values, 0.0))


@pytest.mark.parametrize("mask_kind", MASKS)
def test_compute_returns_is_reward_to_go(mask_kind):
    mask = MASKS[mask_kind]
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    undiscounted = compute_returns(rewards, mask, gamma=1.0)
    masked_rewards = torch.where(mask, rewards, 0.0)
    suffix_sums = masked_rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(undiscounted, torch.where(mask, suffix_sums, 0.0))

    discounted = compute_returns(rewards, mask, gamma=0.9)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            steps = mask[b].cumsum(0)  # the discount counts the policy's tokens, not the environment's
            expected = sum(0.9 ** (steps[k] - steps[t]).item() * masked_rewards[b, k].item()
                           for k in range(t, mask.shape[1]))
            assert discounted[b, t].item() == pytest.approx(expected if mask[b, t] else 0.0, abs=1e-9)


# ----------------------------------------------------------------------------------------------- KL
def test_kl_estimators_equal_their_formulas():
    gen = torch.Generator().manual_seed(4)
    logprobs, ref_logprobs = -torch.rand(2, 4, 6, generator=gen, dtype=torch.float64) * 5
    log_ratio = logprobs - ref_logprobs
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, "k1"), log_ratio)
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, "k2"), 0.5 * log_ratio**2)
    torch.testing.assert_close(
        kl_penalty(logprobs, ref_logprobs, "k3"), torch.exp(ref_logprobs - logprobs) - 1 + log_ratio
    )
    assert kl_penalty(logprobs, ref_logprobs, "k3").shape == (4, 6)
    assert (kl_penalty(logprobs, ref_logprobs, "k3") >= 0).all()
    assert (kl_penalty(logprobs, ref_logprobs, "k2") >= 0).all()


def test_kl_estimators_vanish_when_log_probs_match():
    logprobs = -torch.rand(3, 5, generator=torch.Generator().manual_seed(5)) * 5
    for kind in ("k1", "k2", "k3"):
        assert (kl_penalty(logprobs, logprobs.clone(), kind) == 0).all(), kind


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_k1_and_k3_are_unbiased_for_kl_between_categoricals():
    gen = torch.Generator().manual_seed(6)
    log_p = torch.log_softmax(2 * torch.randn(6, generator=gen, dtype=torch.float64), dim=0)
    log_q = torch.log_softmax(2 * torch.randn(6, generator=gen, dtype=torch.float64), dim=0)
    true_kl = (log_p.exp() * (log_p - log_q)).sum().item()
    reverse_kl = (log_q.exp() * (log_q - log_p)).sum().item()
    # Far enough apart that an estimator of the wrong direction, or the biased k2, lands outside the tolerance.
    assert abs(reverse_kl - true_kl) > 0.2 * true_kl

    samples = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=gen)  # (n,) tokens drawn from p
    for kind in ("k1", "k3"):
        estimate = kl_penalty(log_p[samples], log_q[samples], kind).mean().item()
        assert estimate == pytest.approx(true_kl, rel=0.05), kind
    k2 = kl_penalty(log_p[samples], log_q[samples], "k2").mean().item()
    assert k2 != pytest.approx(true_kl, rel=0.1)


# ----------------------------------------------------------------------------------------------- KL controllers
def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05


def test_adaptive_kl_controller_direction_and_clipping():
    target, horizon, n_steps = 6.0, 10_000, 256

    too_far = AdaptiveKLController(0.1, target, horizon)
    too_far.update(current_kl=60.0, n_steps=n_steps)  # error 9, clipped to 0.2
    assert too_far.value == pytest.approx(0.1 * (1 + 0.2 * n_steps / horizon))

    too_close = AdaptiveKLController(0.1, target, horizon)
    too_close.update(current_kl=0.0, n_steps=n_steps)  # error -1, clipped to -0.2
    assert too_close.value == pytest.approx(0.1 * (1 - 0.2 * n_steps / horizon))

    slightly_far = AdaptiveKLController(0.1, target, horizon)
    slightly_far.update(current_kl=6.6, n_steps=n_steps)  # error 0.1, inside the clip
    assert slightly_far.value == pytest.approx(0.1 * (1 + 0.1 * n_steps / horizon))

    on_target = AdaptiveKLController(0.1, target, horizon)
    on_target.update(current_kl=target, n_steps=n_steps)
    assert on_target.value == pytest.approx(0.1)


def test_adaptive_kl_controller_state_dict_round_trips():
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    for kl in (20.0, 15.0, 1.0):
        controller.update(kl, n_steps=512)
    restored = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value != 0.1
    controller.update(9.0, 512)
    restored.update(9.0, 512)
    assert restored.value == controller.value


def test_adaptive_kl_controller_rejects_bad_target():
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10_000)


# ----------------------------------------------------------------------------------------------- masked statistics
def random_values_and_mask(seed: int, shape=(6, 11)):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.rand(shape, generator=gen) < 0.6
    return values, mask


def test_masked_mean_and_var_match_selection():
    values, mask = random_values_and_mask(7)
    assert masked_mean(values, mask).item() == pytest.approx(values[mask].mean().item())
    assert masked_var(values, mask).item() == pytest.approx(values[mask].var().item())
    per_row = masked_mean(values, mask, dim=1)
    for b in range(values.shape[0]):
        assert per_row[b].item() == pytest.approx(values[b][mask[b]].mean().item())


def test_masked_statistics_of_empty_mask_are_zero_not_nan():
    values = torch.randn(3, 4)
    empty = torch.zeros(3, 4, dtype=torch.bool)
    assert masked_mean(values, empty).item() == 0
    assert masked_var(values, empty).item() == 0
    assert (masked_mean(values, empty, dim=1) == 0).all()
    one = empty.clone()
    one[1, 2] = True
    assert masked_var(values, one).item() == 0
    assert (masked_whiten(values, empty) == 0).all()


def test_masked_whiten_normalises_masked_entries():
    values, mask = random_values_and_mask(8)
    whitened = masked_whiten(values, mask)
    assert whitened[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened[mask].std().item() == pytest.approx(1.0, abs=1e-6)
    assert (whitened[~mask] == 0).all()


def test_masked_whiten_ignores_masked_out_positions():
    values, mask = random_values_and_mask(9)
    changed = torch.where(mask, values, torch.tensor(float("nan")))
    changed[0, ~mask[0]] = 1e6
    torch.testing.assert_close(masked_whiten(changed, mask), masked_whiten(values, mask))


# ----------------------------------------------------------------------------------------------- rewards
def test_place_reward_on_eos_uses_last_masked_position():
    mask = torch.cat([MASKS["left_padded"], right_padded_mask([8, 2], seq=8)])
    scores = torch.tensor([1.5, -2.0, 3.0, 0.25, -1.0, 7.0, 9.0])
    rewards = place_reward_on_eos(scores, mask)
    assert rewards.shape == mask.shape
    for b in range(mask.shape[0]):
        expected = torch.zeros(mask.shape[1])
        positions = mask[b].nonzero()
        if len(positions):
            expected[positions[-1]] = scores[b]
        torch.testing.assert_close(rewards[b], expected)


def test_place_reward_on_eos_empty_row_gets_nothing():
    mask = torch.tensor([[0, 0, 0], [0, 1, 0]])
    rewards = place_reward_on_eos(torch.tensor([5.0, 2.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_compute_token_rewards_is_kl_penalty_plus_score(kind):
    mask = MASKS["left_padded"]
    gen = torch.Generator().manual_seed(13)
    logprobs, ref_logprobs = -torch.rand(2, *mask.shape, generator=gen) * 4
    scores = torch.randn(mask.shape[0], generator=gen)
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    kl[~mask] = float("nan")  # padding may hold anything
    rewards = compute_token_rewards(scores, kl, mask, kl_coef=0.05)

    expected_kl = torch.where(mask, kl_penalty(logprobs, ref_logprobs, kind), 0.0)
    torch.testing.assert_close(rewards, -0.05 * expected_kl + place_reward_on_eos(scores, mask))
    assert (rewards[~mask] == 0).all()


# ----------------------------------------------------------------------------------------------- group advantages
def test_grpo_groups_have_zero_mean_unit_std():
    n = 4
    scores = torch.randn(5 * n, generator=torch.Generator().manual_seed(14), dtype=torch.float64) * 3 + 1
    advantages = group_advantages(scores, n, "grpo").reshape(-1, n)
    torch.testing.assert_close(advantages.mean(dim=1), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(advantages.std(dim=1), torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0)
    # Groups are consecutive samples: the first group is normalised by its own statistics only.
    first = scores[:n]
    torch.testing.assert_close(advantages[0], (first - first.mean()) / (first.std() + 1e-6))


def test_grpo_group_with_equal_scores_gives_zero_not_nan():
    advantages = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3, "grpo")
    assert torch.isfinite(advantages).all()
    assert (advantages[:3] == 0).all()


def test_rloo_matches_leave_one_out_loop():
    n = 3
    scores = torch.randn(4 * n, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    advantages = group_advantages(scores, n, "rloo")
    for i in range(len(scores)):
        start = i // n * n
        others = [scores[j].item() for j in range(start, start + n) if j != i]
        assert advantages[i].item() == pytest.approx(scores[i].item() - sum(others) / len(others))


@pytest.mark.parametrize("kind", ["grpo", "mean", "rloo"])
def test_samples_left_out_count_for_nothing_in_their_groups_baseline(kind):
    """--overlong_filter takes responses cut at the limit out "as if they had not been sampled": a group's kept
    samples get the advantages they would get alone, the others 0. Before, a group scored [1, 0, 0, 0] with its last
    two cut gave its kept pair 1.5 and -0.5 under grpo, for 0.71 and -0.71 without the cut ones."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.5, 3.0, -1.0], dtype=torch.float64)
    keep = torch.tensor([True, True, False, False, True, True, True, False])
    advantages = group_advantages(scores, 4, kind, keep=keep)
    alone = [group_advantages(scores[:2], 2, kind), group_advantages(scores[4:7], 3, kind)]
    torch.testing.assert_close(advantages[keep], torch.cat(alone))
    assert (advantages[~keep] == 0).all()
    lone = group_advantages(scores[:4], 4, kind, keep=torch.tensor([True, False, False, False]))
    assert lone.tolist() == [0.0] * 4, "a sample with no other to compare with has no advantage"
    torch.testing.assert_close(group_advantages(scores, 4, kind, keep=torch.ones(8, dtype=torch.bool)),
                               group_advantages(scores, 4, kind))


def test_rloo_needs_two_samples_per_prompt():
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        group_advantages(torch.randn(4), 1, "rloo")


def test_group_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError, match="does not split into groups"):
        group_advantages(torch.randn(5), 2, "grpo")
    for kind in ("ppo", "reinforce++"):  # reinforce++ has no group baseline: ppo_ray.py never asks for one
        with pytest.raises(ValueError, match=re.escape(f"unknown group advantage '{kind}'")):
            group_advantages(torch.randn(4), 2, kind)


def test_whitening_a_constant_gives_zeros_not_nan():
    mask = MASKS["right_padded"]
    constant = torch.full(mask.shape, 3.0)
    assert (masked_whiten(constant, mask) == 0).all()


# ----------------------------------------------------------------------------------------------- ppo_ray.py
def rollout(estimator: str, seed: int = 16):
    """Four prompts x 2 samples of different lengths, with scores and log-probs: ppo_ray.compute_advantages' input."""
    gen = torch.Generator().manual_seed(seed)
    mask = right_padded_mask([3, 7, 2, 6, 5, 1, 4, 7], seq=7)
    logprobs, ref_logprobs = -torch.rand(2, *mask.shape, generator=gen) * 2
    args = SimpleNamespace(advantage_estimator=estimator, n_samples_per_prompt=2, gamma=1.0, lambd=0.95,
                           policy_loss="ppo")
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    values = torch.randn(mask.shape, generator=gen)
    return args, scores, kl_penalty(logprobs, ref_logprobs, "k1"), values, mask


def test_rloo_advantages_are_the_leave_one_out_returns_unwhitened():
    """OpenRLHF whitens gae and reinforce++ advantages only: whitening RLOO's token returns over the batch would
    subtract a mean over all tokens, a baseline that depends on the responses' lengths."""
    args, scores, kl, values, mask = rollout("rloo")
    advantages, returns = ppo_ray.compute_advantages(args, scores, kl, values, mask, kl_coef=0.1)
    baselined = group_advantages(scores, 2, "rloo")
    expected = compute_returns(compute_token_rewards(baselined, kl, mask, 0.1), mask, 1.0)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


@pytest.mark.parametrize("estimator", ["gae", "reinforce++"])
def test_gae_and_reinforce_advantages_are_whitened(estimator):
    args, scores, kl, values, mask = rollout(estimator)
    advantages, _ = ppo_ray.compute_advantages(args, scores, kl, values, mask, kl_coef=0.1)
    assert masked_mean(advantages, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(advantages, mask).item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce++-baseline"])
def test_a_response_the_overlong_filter_took_out_moves_no_other_responses_advantage(estimator):
    """make_experience zeroes a cut response's action mask; its score, whatever it is, must not reach its group's
    baseline."""
    args, scores, kl, values, mask = rollout(estimator)
    args.n_samples_per_prompt = 4
    mask[1] = 0  # the second response of the first group of four: cut at the limit
    advantages, _ = ppo_ray.compute_advantages(args, scores, kl, values, mask, kl_coef=0.1)
    changed = scores.clone()
    changed[1] = 100.0
    moved, _ = ppo_ray.compute_advantages(args, changed, kl, values, mask, kl_coef=0.1)
    torch.testing.assert_close(moved, advantages)
    assert advantages[:4].abs().sum() > 0, "the group's advantages are all 0: no test"


def test_every_ppo_trick_is_run_by_a_script():
    """Code that no script runs is checked by nothing but its own tests: each public function and class of
    common/ppo_tricks.py must be called from a top-level script (or the rollouts ppo_ray.py hands to
    common/rollout.py) or from another trick that is."""
    public = {name for name, value in vars(ppo_tricks).items()
              if callable(value) and getattr(value, "__module__", None) == ppo_tricks.__name__
              and not name.startswith("_")}
    used = set()
    scripts = sorted(f for f in os.listdir(ROOT) if f.endswith(".py")) + [os.path.join("common", "rollout.py")]
    for script in scripts + [os.path.join("common", "ppo_tricks.py")]:
        tree = ast.parse(open(os.path.join(ROOT, script)).read())
        defined_here = script.endswith("ppo_tricks.py")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not defined_here:
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and node.module == ppo_tricks.__name__ and not defined_here:
                used.update(alias.name for alias in node.names)  # `from common.ppo_tricks import uses_reference`
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and defined_here:
                used.add(node.func.id)
    assert not public - used, f"defined in common/ppo_tricks.py but run by no script: {sorted(public - used)}"


# ------------------------------------------------------------------------------ modern estimators and losses
def test_group_mean_baseline_is_not_divided_by_the_std():
    """Dr. GRPO and REINFORCE++-baseline: the score minus its group's mean, worked by hand."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 4.0, 6.0])  # two prompts x 4 samples
    assert group_advantages(scores, 4, "mean").tolist() == [0.75, -0.25, -0.25, -0.25, -2.0, 0.0, 0.0, 2.0]
    grpo = group_advantages(scores, 4, "grpo")  # the same centring, divided by each group's std (0.5, 1.633)
    torch.testing.assert_close(grpo[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6))


def test_reinforce_baseline_advantages_are_group_centred_returns_whitened_over_the_batch():
    args, scores, kl, values, mask = rollout("reinforce++-baseline")
    advantages, returns = ppo_ray.compute_advantages(args, scores, kl, values, mask, kl_coef=0.1)
    centred = scores - scores.reshape(-1, 2).mean(1).repeat_interleave(2)
    expected = compute_returns(compute_token_rewards(centred, kl, mask, 0.1), mask, 1.0)
    torch.testing.assert_close(returns, expected)
    torch.testing.assert_close(advantages, masked_whiten(expected, mask))


def test_dr_grpo_advantages_are_centred_scores_on_every_token_and_its_loss_is_not_length_normalised():
    args, scores, kl, values, mask = rollout("dr_grpo")
    args.loss_agg = None
    advantages, _ = ppo_ray.compute_advantages(args, scores, kl, values, mask, kl_coef=0.1)
    centred = scores - scores.reshape(-1, 2).mean(1).repeat_interleave(2)  # [0.5, -0.5, -0.5, 0.5, 0, 0, -0.5, 0.5]
    torch.testing.assert_close(advantages, centred[:, None] * mask)
    assert ppo_ray.loss_agg(args) == "seq-mean-token-sum-norm"


def test_loss_aggregations_worked_by_hand():
    """Two responses, 1 and 3 tokens long, with per-token losses 4 | 1 1 1."""
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(7 / 4)  # every token alike
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((4 + 1) / 2)  # every response alike
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((4 / 8 + 3 / 8) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(loss, mask, "sum")


def test_the_kl_metric_the_adaptive_controller_steers_by_leaves_out_filtered_responses():
    """Four responses with a per-token KL of 0.5, two of them taken out by --overlong_filter: the KL is 0.5, not
    0.25, or the controller would lower beta for no reason."""
    args = SimpleNamespace(kl_estimator="k1")
    ref_logprobs = torch.zeros(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0] * 5, [0] * 5])
    batch = {"ref_logprobs": ref_logprobs, "vllm_logprobs": ref_logprobs}
    metrics = ppo_ray.old_logprob_metrics(args, ref_logprobs + 0.5, batch, mask)
    assert metrics["objective/kl"].item() == pytest.approx(0.5)


def test_a_response_with_no_masked_token_counts_in_no_mean():
    """--overlong_filter zeroes a truncated response's mask: the loss is the one of the batch without it."""
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate(loss, mask, mode, max_len=8).item() == pytest.approx(
            aggregate(loss[:2], mask[:2], mode, max_len=8).item()), mode
        assert aggregate(loss, torch.zeros_like(mask), mode, max_len=8).item() == 0.0, mode


def test_clip_higher_and_dual_clip_worked_by_hand():
    """One token per case: the ratio r = exp(logprob - old), the advantage A, and the surrogate PPO maximises."""
    ratio = torch.tensor([[1.25, 1.25, 0.9, 10.0, 10.0]])
    advantage = torch.tensor([[1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones_like(ratio)
    old = torch.zeros_like(ratio)

    def surrogate(**kwargs):
        loss, clipfrac, _ = ppo_ray.policy_loss(ratio.log(), old, advantage, mask, **kwargs,
                                                agg="seq-mean-token-sum-norm")  # the sum over the 5 tokens
        return -loss.item(), clipfrac.item()

    # symmetric 0.2: min(rA, clip(r, 0.8, 1.2) A) = 1.2, -1.25, -0.9, -10, 1.2; 4 of 5 ratios outside the range
    assert surrogate(clip_low=0.2, clip_high=0.2) == pytest.approx((1.2 - 1.25 - 0.9 - 10 + 1.2, 4 / 5))
    # clip-higher 0.28: 1.25 is inside now, and the last token's gain is cut at 1.28
    assert surrogate(clip_low=0.2, clip_high=0.28) == pytest.approx((1.25 - 1.25 - 0.9 - 10 + 1.28, 2 / 5))
    # dual clip 3: a negative advantage loses at most 3 |A|: the fourth token's -10 becomes -3
    assert surrogate(clip_low=0.2, clip_high=0.2, dual_clip=3.0)[0] == pytest.approx(1.2 - 1.25 - 0.9 - 3 + 1.2)
    # weights multiply each token's surrogate
    weights = torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0]])
    assert surrogate(clip_low=0.2, clip_high=0.2, weights=weights)[0] == pytest.approx(2.4 - 1.25 - 0.9 + 1.2)


def test_padding_that_would_overflow_exp_leaves_the_gradients_finite():
    """The update's micro-batches are laid out apart from the experience's, so at padding and prompt columns the
    old and reference log-probs (zero-padded) face real log-probs of the pad token; at a low temperature their
    difference passes exp's range (~88.7). The loss masked that inf out, but its gradient was 0 * inf = NaN, and one
    step spread it to every weight."""
    logits = torch.zeros(1, 4, requires_grad=True)  # stands for the model's output
    # columns 2-3 are not response tokens: a pad token's log-prob at temperature 0.3 in the update, 0 where its
    # micro-batch starts later; the experience had the other layout (a prompt token's log-prob, or 0)
    logprobs = logits + torch.tensor([[-1.0, -2.0, -100.0, 0.0]])
    old = torch.tensor([[-1.1, -1.9, 0.0, -100.0]])
    ref = torch.tensor([[-1.2, -1.8, 0.0, -100.0]])
    mask = torch.tensor([[1, 1, 0, 0]])
    advantages = torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    loss, _, _ = ppo_ray.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    kl = kl_penalty(logprobs, ref, "k3", mask)
    (loss + aggregate(kl, mask, "token-mean")).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[0, 2:] == 0).all() and (logits.grad[0, :2] != 0).all()
    assert kl[0, 2:].tolist() == [0.0, 0.0] and (kl[0, :2] > 0).all()


def test_truncated_importance_weights_worked_by_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    vllm = torch.tensor([[-1.0, -2.0, -0.5, float("nan")]])  # ratios 1, e, e^-0.5; the last is not a response token
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, capped = ppo_ray.rollout_correction("tis", old, vllm, mask, 0.5, 2.0, (0.999, 1.001))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, math.exp(-0.5), 0.0]]))
    assert capped.item() == pytest.approx(1 / 3)


# ------------------------------------------------------------------ the 2026 policy losses and rollout corrections
def surrogate_and_grad(kind, log_ratios, advantage, clip=(0.2, 0.2), **kwargs):
    """One response of len(log_ratios) tokens: -loss (the mean over its tokens) and d(-loss)/d log pi per token."""
    logprobs = torch.tensor([log_ratios], requires_grad=True)
    mask = torch.ones_like(logprobs)
    loss, clipfrac, _ = ppo_ray.policy_loss(logprobs, torch.zeros_like(logprobs), torch.full_like(logprobs, advantage),
                                            mask, *clip, kind=kind, **kwargs)
    (-loss).backward()
    return -loss.item(), logprobs.grad[0].tolist(), clipfrac.item()


def test_gspo_clips_the_responses_ratio_and_gives_each_token_its_gradient():
    """Log-ratios 0.1 and 0.3: the response's ratio s = e^0.2 = 1.221. Inside the clip range the objective is s and
    each token's gradient is s / 2 (d s / d log pi_t, the sequence objective's); outside it, nothing moves."""
    s = math.exp(0.2)
    value, grad, clipfrac = surrogate_and_grad("gspo", [0.1, 0.3], 1.0, clip=(0.3, 0.3))
    assert value == pytest.approx(s) and grad == pytest.approx([s / 2, s / 2]) and clipfrac == 0.0
    value, grad, clipfrac = surrogate_and_grad("gspo", [0.1, 0.3], 1.0, clip=(0.2, 0.2))
    assert value == pytest.approx(1.2) and grad == [0.0, 0.0] and clipfrac == 1.0
    value, _, _ = surrogate_and_grad("gspo", [0.1, 0.3], -1.0, clip=(0.2, 0.2))
    assert value == pytest.approx(-s)  # a negative advantage keeps the unclipped, worse value


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    """Ratios e^0.5 = 1.65 and 1, clip_high 0.2: PPO would drop the first token's gradient; CISPO weighs it 1.2."""
    _, grad, clipfrac = surrogate_and_grad("cispo", [0.5, 0.0], 2.0)
    assert grad == pytest.approx([1.2 * 2.0 / 2, 1.0 * 2.0 / 2]) and clipfrac == 0.5
    _, ppo_grad, _ = surrogate_and_grad("ppo", [0.5, 0.0], 2.0)
    assert ppo_grad[0] == 0.0


def test_gmpo_is_the_geometric_mean_of_log_space_clipped_ratios():
    """Log-ratios 0.5 and -0.1, clip 0.4 in log space: for A > 0 min(l, clip(l)) = 0.4, -0.1, so exp(0.15) A; for
    A < 0 max(l, clip(l)) = 0.5, -0.1, so exp(0.2) A."""
    value, _, clipfrac = surrogate_and_grad("gmpo", [0.5, -0.1], 1.0, clip=(0.4, 0.4))
    assert value == pytest.approx(math.exp(0.15)) and clipfrac == 0.5
    value, _, _ = surrogate_and_grad("gmpo", [0.5, -0.1], -2.0, clip=(0.4, 0.4))
    assert value == pytest.approx(-2.0 * math.exp(0.2))


def test_sapo_gates_softly_and_matches_ppos_gradient_on_policy():
    """At r = 1 the gate (4 / tau) sigmoid(tau (r - 1)) has slope 1: the gradient is PPO's, A per token. Far off
    policy the gradient fades instead of stopping: r = e^1 with A > 0 still moves, less than on policy."""
    _, grad, _ = surrogate_and_grad("sapo", [0.0], 1.5)
    assert grad == pytest.approx([1.5])
    value, _, _ = surrogate_and_grad("sapo", [0.0], -1.0, sapo_tau=(1.0, 1.05))
    assert value == pytest.approx(-4 / 1.05 * 0.5)  # the negative advantage's temperature
    _, far, _ = surrogate_and_grad("sapo", [1.0], 1.0)
    assert 0 < far[0] < math.e  # e * 4 sigmoid'(1) = 1.07 < PPO's unclipped e, > PPO's clipped 0


def test_rollout_corrections_worked_by_hand():
    """pi_old / pi_vllm of 0.4, 1 and 6, and a second response of ratios e^0.1 = 1.105: IcePop drops the tokens
    outside [0.5, 5] and keeps the others' ratio; sequence-masked TIS with the sequence band [0.8, 1.2] drops the
    first response whole (its geometric mean is (0.4 x 6)^(1/3) = 1.34) and keeps the second's tokens, weighed by
    their ratio; TIS caps 6 at 2."""
    old = torch.log(torch.tensor([[0.4, 1.0, 6.0], [1.0, 1.0, 1.0]]))
    old[1] = 0.1
    vllm = torch.zeros_like(old)
    mask = torch.ones_like(old)
    weights, masked = ppo_ray.rollout_correction("icepop", old, vllm, mask, 0.5, 5.0, (0.999, 1.001))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0], [math.exp(0.1)] * 3]))
    assert masked.item() == pytest.approx(2 / 6)
    weights, masked = ppo_ray.rollout_correction("seq-mask-tis", old, vllm, mask, 0.5, 2.0, (0.8, 1.2))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 0.0], [math.exp(0.1)] * 3]))
    assert masked.item() == pytest.approx(3 / 6)
    weights, capped = ppo_ray.rollout_correction("tis", old, vllm, mask, 0.5, 2.0, (0.8, 1.2))
    torch.testing.assert_close(weights[0], torch.tensor([0.4, 1.0, 2.0])) and capped.item() == pytest.approx(1 / 6)


@pytest.mark.parametrize("flags,words", [
    ({"eps_clip_low": 1.0}, "clip range [1 - 1.0, 1 + 0.2] is empty"),
    ({"policy_loss": "gmpo"}, "gmpo takes one advantage per response and gae's advantages differ token by token"),
    ({"policy_loss": "sapo", "dual_clip": 3.0}, "leave it out with --policy_loss sapo"),
    ({"policy_loss": "sapo", "sapo_tau_neg": 0.0}, "must be above 0 (1.0 and 1.05 in its paper)"),
    ({"vllm_is_floor": 1.0}, "--vllm_is_floor 1.0 must be in (0, 1)"),
    ({"dual_clip": 0.5}, "--dual_clip 0.5 must be above 1"),
    ({"vllm_is_cap": 0.5}, "--vllm_is_cap 0.5 would down-weight"),
    ({"advantage_estimator": "reinforce++-baseline"}, "compares samples of the same prompt"),
    ({"overlong_buffer_len": 64}, "--overlong_buffer_len 64 must be below --generate_max_len 64"),
    ({"dynamic_sampling": True}, "with --advantage_estimator grpo, dr_grpo, rloo, reinforce++-baseline, not gae"),
    ({"dynamic_sampling": True, "dynamic_sampling_max_rounds": 0, "advantage_estimator": "grpo",
      "n_samples_per_prompt": 2}, "--dynamic_sampling_max_rounds 0 leaves nothing to train on"),
    ({"async_rollouts": True, "colocate_all": True}, "--async_rollouts cannot be used with --colocate_all"),
    ({"async_rollouts": True, "dynamic_sampling": True, "advantage_estimator": "grpo", "n_samples_per_prompt": 2},
     "--async_rollouts cannot be used with --dynamic_sampling"),
    ({"env_fn": "env.py:make_env"}, "--env_fn's rewards score the episodes; leave out --reward_fn, or --env_fn."),
    ({"env_fn": "env.py:make_env", "reward_fn": None, "max_turns": 0}, "--max_turns 0 gives the policy no turn"),
    ({"env_fn": "env.py:make_env", "reward_fn": None, "reward_weights": [5.0]},  # there is nothing to weigh
     "--env_fn's rewards score the episodes; leave out --reward_weights, or --env_fn."),
    ({"reward_clip": 0.0}, "--reward_clip 0.0 must be above 0: rewards are clipped to [-clip, clip]"),
    ({"temperature": 0.0}, "give a temperature above 0"),  # log-probs of logits / 0: NaN
    ({"top_p": 0.0}, "and a top_p in (0, 1]"),
    ({"init_kl_coef": 0.0, "kl_target": 0.1}, "the adaptive controller scales the coefficient up and down"),
    ({"kl_target": -1.0}, "so both must be above 0"),
    ({"env_fn": "env.py:make_env", "reward_fn": None, "async_rollouts": True},
     "--async_rollouts cannot be used with --env_fn"),
    ({"agent_fn": "a.py:run_agent", "env_fn": "env.py:make_env", "reward_fn": None},
     "--env_fn and --agent_fn each run the episodes; give one of them."),
    ({"agent_fn": "a.py:run_agent"}, "--agent_fn's rewards score the episodes; leave out --reward_fn, or --agent_fn."),
    ({"agent_fn": "a.py:run_agent", "reward_fn": None}, "--agent_fn's agents send chat messages, which the policy's "
                                                        "chat template renders; add --apply_chat_template."),
    ({"agent_fn": "a.py:run_agent", "reward_fn": None, "apply_chat_template": True, "agent_timeout": 0.0},
     "--agent_timeout 0.0 gives an agent no time"),
    ({"agent_fn": "a.py:run_agent", "reward_fn": None, "apply_chat_template": True, "async_rollouts": True},
     "--async_rollouts cannot be used with --agent_fn"),
    ({"max_staleness": 2}, "--max_staleness sets up --partial_rollouts; add --partial_rollouts, or leave out"),
    ({"partial_chunk_tokens": 8}, "--partial_chunk_tokens sets up --partial_rollouts"),
    ({"partial_rollouts": True}, "--partial_rollouts cuts the generation --async_rollouts runs during the update"),
    ({"partial_rollouts": True, "async_rollouts": True, "max_staleness": -1}, "--max_staleness -1 leaves no policy"),
    ({"partial_rollouts": True, "async_rollouts": True, "partial_chunk_tokens": 0},
     "--partial_chunk_tokens 0 generates nothing"),
    ({"partial_rollouts": True, "async_rollouts": True, "routing_replay": True},
     "--partial_rollouts samples a response over several; leave out one of the two."),
])
def test_new_loss_flags_that_cannot_work_are_refused(flags, words):
    with pytest.raises(UserError, match=re.escape(words)):
        ppo_ray.check_args(ppo_ray.Args(**{"pretrain": "unused", "reward_fn": "unused.py:f", **flags}))


def test_overlong_penalty_worked_by_hand():
    """Limit 16 tokens, a buffer of 4: nothing up to 12 tokens, then -factor/4 per token, -factor at 16."""
    lengths = torch.tensor([3, 12, 13, 15, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]


def test_groups_with_a_spread_worked_by_hand():
    """Three prompts of three samples: all wrong, mixed, all right (with a float sum that is right within 1e-6)."""
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0 + 1e-8])
    assert groups_with_a_spread(scores, 3).tolist() == [False, True, False]
    assert groups_with_a_spread(scores, 1).tolist() == [False] * 9  # one sample has no spread
    # each of them is a group whose advantages are all zero under every group baseline
    for kind in ("grpo", "mean", "rloo"):
        zero = group_advantages(scores, 3, kind).view(3, 3).abs().amax(dim=1) < 1e-5
        assert zero.tolist() == [True, False, True], kind


# ----------------------------------------------------------------------------------------------- each option learns
def toy_learning(estimator: str, steps: int = 30, **flags) -> tuple[float, float]:
    """ppo_ray.py's update on a toy problem, without Ray, vLLM or a model: a policy of 4 tokens per position over 4
    positions (a logits table), prompts of 4 samples, responses of 1 to 4 tokens, and a reward for each token 0 in
    the response (its share of them). Each step samples, computes advantages with ppo_ray.compute_advantages (a
    critic that always says 0 for gae) and takes two epochs of ppo_ray.policy_loss with --max_epochs' reuse of the
    old log-probs. Returns the expected reward (the probability of token 0) before and after."""
    torch.manual_seed(0)
    positions, vocab, batch = 4, 4, 32
    logits = torch.zeros(positions, vocab, requires_grad=True)
    reference = logits.detach().clone()
    optimizer = torch.optim.Adam([logits], lr=0.05)
    args = ppo_ray.Args(advantage_estimator=estimator, n_samples_per_prompt=4, **flags)

    def logprobs_of(table, tokens):
        return torch.log_softmax(table, -1).gather(1, tokens.T).T  # (batch, positions)

    for _ in range(steps):
        with torch.no_grad():
            tokens = torch.distributions.Categorical(logits=logits).sample((batch,))  # (batch, positions)
            mask = torch.arange(positions)[None] < torch.randint(1, positions + 1, (batch, 1))
            scores = ppo_tricks.masked_mean((tokens == 0).float(), mask, dim=1)
            old = logprobs_of(logits, tokens)
            kl = kl_penalty(old, logprobs_of(reference, tokens), "k1")
            advantages, _ = ppo_ray.compute_advantages(args, scores, kl, torch.zeros_like(old), mask, 0.001)
            # a sampler that differs from the trainer a little, as vLLM does, for --vllm_is_correction
            weights, _ = ppo_ray.vllm_correction(args, old, old + 0.1 * torch.randn_like(old), mask)
        for _epoch in range(2):
            loss, _, _ = ppo_ray.policy_loss(logprobs_of(logits, tokens), old, advantages, mask,
                                             *ppo_ray.clip_range(args), args.dual_clip,
                                             weights if args.vllm_is_correction else None, ppo_ray.loss_agg(args),
                                             positions, kind=args.policy_loss,
                                             sapo_tau=(args.sapo_tau_pos, args.sapo_tau_neg))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return 1 / vocab, torch.softmax(logits.detach(), -1)[:, 0].mean().item()


@pytest.mark.parametrize("estimator,flags", [
    ("gae", {}), ("reinforce++", {}), ("reinforce++-baseline", {}), ("grpo", {}), ("dr_grpo", {}), ("rloo", {}),
    ("grpo", {"loss_agg": "seq-mean-token-mean"}), ("grpo", {"loss_agg": "seq-mean-token-sum-norm"}),
    ("grpo", {"eps_clip_high": 0.28}), ("grpo", {"dual_clip": 3.0}), ("grpo", {"vllm_is_correction": True}),
    ("grpo", {"policy_loss": "gspo", "eps_clip_low": 3e-4, "eps_clip_high": 4e-4}), ("grpo", {"policy_loss": "gspo"}),
    ("grpo", {"policy_loss": "cispo", "eps_clip_high": 4.0}), ("grpo", {"policy_loss": "gmpo", "eps_clip": 0.4}),
    ("grpo", {"policy_loss": "sapo"}), ("gae", {"policy_loss": "cispo"}), ("gae", {"policy_loss": "sapo"}),
    ("grpo", {"vllm_is_correction": True, "vllm_is_kind": "icepop"}),
    # the toy sampler's 0.1-nat noise per token is far beyond a real vLLM's: a sequence band to match it
    ("grpo", {"vllm_is_correction": True, "vllm_is_kind": "seq-mask-tis", "vllm_rs_threshold_lower": 0.9,
              "vllm_rs_threshold": 1.1}),
])
def test_each_estimator_and_loss_option_learns_a_toy_problem(estimator, flags):
    """The sign, the baseline and the aggregation of every estimator and loss option, on a toy problem: the
    probability of the rewarded token must rise from 0.25 to well above half in 30 steps (each reaches 0.94-0.96).
    That each flag reaches the loss in the actor's update is test_ppo_workers.py's test."""
    before, after = toy_learning(estimator, **flags)
    assert after > 0.6, (estimator, flags, before, after)
