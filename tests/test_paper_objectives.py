"""Each objective at the settings a user gets by naming it, against its paper's formula written here independently.

Every policy loss, rollout correction and advantage estimator of ppo_ray.py, and the preference losses of dpo.py,
kto.py and rm.py, on batches of several responses of different lengths with padding (which holds values that would
overflow an exp), both advantage signs and groups of two: values and gradients. The references loop over responses
and tokens one at a time, so they share no aggregation, mask or broadcast with the code they check. The flags come
from each script's Args with only the option named, so a default that drifts from the paper fails here too.
`make mutation` (tests/mutation.py) breaks the code under test on purpose and checks that these tests notice.
"""

import math
import re

import pytest
import torch

import dpo
import ppo_ray
from common import ppo_tricks
from common.args import UserError
from kto import kto_loss
from rm import pairwise_loss

LENGTHS = [1, 3, 5, 2]  # four responses, right-padded to SEQ: two prompts x two samples
SEQ = 6
GARBAGE = 88.0  # what a padding position holds: exp(88) overflows float32


def response_batch(seed: int, spread: float, per_token: bool = False):
    """(logprobs with grad, old log-probs, advantages, mask), each (4, SEQ): log-ratios of about `spread` nats,
    advantages +1, -1, +0.5, -2 per response (a per-token jitter with `per_token`), GARBAGE in the padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]).float()
    old = -torch.rand(4, SEQ, generator=gen) * 2 - 0.1
    logprobs = old + spread * torch.randn(4, SEQ, generator=gen)
    logprobs = torch.where(mask.bool(), logprobs, GARBAGE).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(4, SEQ).clone()
    if per_token:
        advantages = advantages + 0.7 * torch.randn(4, SEQ, generator=gen)
    return logprobs, torch.where(mask.bool(), old, -GARBAGE), torch.where(mask.bool(), advantages, GARBAGE), mask


def policy_loss_at_defaults(kind, logprobs, old, advantages, mask, weights=None, **flags):
    """ppo_ray.policy_loss as ActorWorker.fit calls it, with --policy_loss `kind` and `flags` given, nothing else."""
    args = ppo_ray.Args(policy_loss=kind, advantage_estimator="grpo", n_samples_per_prompt=2, **flags)
    loss, _, _ = ppo_ray.policy_loss(logprobs, old, advantages, mask, *ppo_ray.clip_range(args), args.dual_clip,
                                     weights, ppo_ray.loss_agg(args), args.generate_max_len, kind=kind,
                                     sapo_tau=(args.sapo_tau_pos, args.sapo_tau_neg))
    return loss


def tokens(values, i):
    """Response i's valid tokens of a (4, SEQ) tensor, one scalar tensor each (autograd follows them)."""
    return [values[i, t] for t in range(LENGTHS[i])]


def clip(x, low, high):
    return torch.clamp(x, 1 - low, 1 + high)


def token_mean(terms_per_response):
    """DAPO's token-mean: every token of the batch weighs the same."""
    flat = [term for terms in terms_per_response for term in terms]
    return sum(flat) / len(flat)


def response_mean(terms_per_response):
    """GRPO's seq-mean-token-mean: each response's token mean, then the mean over responses."""
    return sum(sum(terms) / len(terms) for terms in terms_per_response) / len(terms_per_response)


def ppo_terms(logprobs, old, advantages, low, high, dual_clip=None):
    """Schulman et al. 2017, eq. 7 per token; Ye et al. 2020's dual clip max(J, c A) where A < 0."""
    per_response = []
    for i in range(4):
        terms = []
        for lp, o, a in zip(tokens(logprobs, i), tokens(old, i), tokens(advantages, i)):
            r = torch.exp(lp - o)
            j = torch.minimum(r * a, clip(r, low, high) * a)
            if dual_clip is not None and a < 0:
                j = torch.maximum(j, dual_clip * a)
            terms.append(j)
        per_response.append(terms)
    return per_response


def gspo_sequence_objective(logprobs, old, advantages, low=3e-4, high=4e-4):
    """GSPO (Zheng et al. 2025, eqs. 5-7): s_i = (prod_t r_t)^(1 / |y_i|), min(s A, clip(s) A) per response,
    averaged over responses; its paper's clip range 3e-4 / 4e-4."""
    per_response = []
    for i in range(4):
        log_ratios = [lp - o for lp, o in zip(tokens(logprobs, i), tokens(old, i))]
        s = torch.exp(sum(log_ratios) / len(log_ratios))
        a = advantages[i, 0]
        per_response.append([torch.minimum(s * a, clip(s, low, high) * a)])
    return per_response


def assert_value_and_gradient(loss, reference, logprobs, gradient=None):
    """loss and the reference agree in value, and in gradient (the reference's by autograd, or the one given)."""
    (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
    if gradient is None:
        (gradient,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(loss, reference.detach() if torch.is_tensor(reference) else torch.tensor(reference))
    assert torch.isfinite(grad).all(), "padding reached the gradient"
    torch.testing.assert_close(grad, gradient, rtol=1e-4, atol=1e-6)
    assert grad.abs().sum() > 0, "no gradient at all: the batch tests nothing"


# ----------------------------------------------------------------------------------------------- policy losses
@pytest.mark.parametrize("spread", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("per_token", [False, True])
def test_ppo_at_its_defaults_is_the_clipped_surrogate_averaged_over_tokens(spread, per_token):
    logprobs, old, advantages, mask = response_batch(1, spread, per_token)
    loss = policy_loss_at_defaults("ppo", logprobs, old, advantages, mask)
    assert_value_and_gradient(loss, -token_mean(ppo_terms(logprobs, old, advantages, 0.2, 0.2)), logprobs)


def test_ppo_with_clip_higher_and_dual_clip_is_what_the_flags_give():
    logprobs, old, advantages, mask = response_batch(2, 1.0, per_token=True)
    loss = policy_loss_at_defaults("ppo", logprobs, old, advantages, mask, eps_clip_high=0.28, dual_clip=3.0)
    reference = -token_mean(ppo_terms(logprobs, old, advantages, 0.2, 0.28, dual_clip=3.0))
    assert_value_and_gradient(loss, reference, logprobs)


@pytest.mark.parametrize("spread", [0.0, 2e-4, 6e-4])  # the clip range is 3e-4 / 4e-4
def test_gspo_at_its_defaults_is_its_papers_sequence_objective(spread):
    """With one advantage per response, GSPO-token's value and gradient are the sequence objective's, at the clip
    range 3e-4 / 4e-4 and the mean over responses its paper gives (a 1-token and a 5-token response weigh alike)."""
    logprobs, old, advantages, mask = response_batch(3, spread)
    loss = policy_loss_at_defaults("gspo", logprobs, old, advantages, mask)
    reference = -response_mean(gspo_sequence_objective(logprobs, old, advantages))
    assert_value_and_gradient(loss, reference, logprobs)


def test_gspo_named_alone_weighs_responses_not_tokens_worked_by_hand():
    """The issue's case: two responses of 1 and 3 tokens, on policy, A = +1 and -1. The paper's loss is
    -(1 - 1) / 2 = 0; each token's gradient is -A / (2 |y|): -0.5 for the short response, +1/6 for the long one."""
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    advantages = torch.tensor([[1.0, 1, 1], [-1, -1, -1]]) * mask
    loss = policy_loss_at_defaults("gspo", logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


@pytest.mark.parametrize("spread", [2e-4, 0.3])
def test_gspo_token_takes_each_tokens_advantage(spread):
    """GSPO-token (Zheng et al. 2025, its token-level variant): s_{i,t} = sg(s_i) pi_t / sg(pi_t), min(s_{i,t} A_t,
    clip(s_{i,t}) A_t) per token, the response's token mean, the mean over responses. The gradient, by hand: token t
    gets -A_t s_i / (G |y_i|) where its term is not clipped."""
    logprobs, old, advantages, mask = response_batch(4, spread, per_token=True)
    loss = policy_loss_at_defaults("gspo", logprobs, old, advantages, mask)
    value, gradient = 0.0, torch.zeros(4, SEQ)
    for i, n in enumerate(LENGTHS):
        s = math.exp(sum((logprobs[i, t] - old[i, t]).item() for t in range(n)) / n)
        for t in range(n):
            a = advantages[i, t].item()
            value -= min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a) / n / 4
            unclipped = (s <= 1 + 4e-4) if a > 0 else (s >= 1 - 3e-4)
            gradient[i, t] = -a * s / n / 4 if unclipped else 0.0
    assert_value_and_gradient(loss, torch.tensor(value), logprobs, gradient)


@pytest.mark.parametrize("spread", [0.0, 0.3, 2.0])
def test_cispo_at_its_defaults_clips_the_weight_at_five_and_keeps_each_tokens_gradient(spread):
    """CISPO (MiniMax-M1 2025, eq. 4): sg(min(r_t, 5)) A_t log pi_t over every token (TRL's epsilon_high 5); the
    gradient, by hand, -min(r_t, 5) A_t / N: never zero, however far the ratio."""
    logprobs, old, advantages, mask = response_batch(5, spread, per_token=True)
    loss = policy_loss_at_defaults("cispo", logprobs, old, advantages, mask)
    count = sum(LENGTHS)
    value, gradient = 0.0, torch.zeros(4, SEQ)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            weight = min(math.exp((logprobs[i, t] - old[i, t]).item()), 5.0)
            value -= weight * advantages[i, t].item() * logprobs[i, t].item() / count
            gradient[i, t] = -weight * advantages[i, t].item() / count
    assert_value_and_gradient(loss, torch.tensor(value), logprobs, gradient)


@pytest.mark.parametrize("spread", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("flags,low,high", [({}, 0.4, 0.4), ({"eps_clip_low": 0.1, "eps_clip_high": 0.3}, 0.1, 0.3)])
def test_gmpo_at_its_defaults_is_the_mean_over_responses_of_each_geometric_mean(spread, flags, low, high):
    """GMPO (Zhao et al. 2025, eq. 5): A_i (prod_t clipped r_t)^(1 / |y_i|), each ratio clipped to (e^-0.4, e^0.4)
    from the side that would raise the objective, then the mean over responses; clip flags the user gives win."""
    logprobs, old, advantages, mask = response_batch(6, spread)
    loss = policy_loss_at_defaults("gmpo", logprobs, old, advantages, mask, **flags)
    per_response = []
    for i in range(4):
        a = advantages[i, 0]
        log_ratios = [lp - o for lp, o in zip(tokens(logprobs, i), tokens(old, i))]
        kept = [torch.clamp(x, max=high) if a > 0 else torch.clamp(x, min=-low) for x in log_ratios]
        per_response.append([a * torch.exp(sum(kept) / len(kept))])
    assert_value_and_gradient(loss, -response_mean(per_response), logprobs)


@pytest.mark.parametrize("spread", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("per_token", [False, True])
def test_sapo_at_its_defaults_gates_softly_and_averages_each_responses_tokens(spread, per_token):
    """SAPO (Gao et al. 2025, eq. 6): (4 / tau) sigmoid(tau (r_t - 1)) A_t, tau 1.0 where A_t > 0 and 1.05
    where not, each response's token mean, then the mean over responses."""
    logprobs, old, advantages, mask = response_batch(7, spread, per_token)
    loss = policy_loss_at_defaults("sapo", logprobs, old, advantages, mask)
    per_response = []
    for i in range(4):
        terms = []
        for lp, o, a in zip(tokens(logprobs, i), tokens(old, i), tokens(advantages, i)):
            tau = 1.0 if a > 0 else 1.05
            terms.append(4 / tau / (1 + torch.exp(-tau * (torch.exp(lp - o) - 1))) * a)
        per_response.append(terms)
    assert_value_and_gradient(loss, -response_mean(per_response), logprobs)


@pytest.mark.parametrize("kind", ppo_ray.POLICY_LOSSES)
def test_a_valid_token_with_an_extreme_log_ratio_leaves_every_gradient_finite(kind):
    """A token whose log-ratio is ~89 (exp overflows float32) must not make the gradient NaN: the log-ratio is
    clamped at +-20, as verl does."""
    logprobs, old, advantages, mask = response_batch(8, 0.1)
    with torch.no_grad():
        logprobs[1, 1] = old[1, 1] + 89.0
        logprobs[2, 0] = old[2, 0] - 89.0
    loss = policy_loss_at_defaults(kind, logprobs, old, advantages, mask)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("kind", ppo_ray.POLICY_LOSSES)
def test_padding_that_holds_nan_changes_neither_the_loss_nor_its_gradient(kind):
    """Padding may hold anything, another micro-batch's layout or NaN: the loss and its gradient are those of the
    same batch with zeros there."""
    logprobs, old, advantages, mask = response_batch(10, 0.3)
    results = []
    for fill in (0.0, float("nan")):
        padded = torch.where(mask.bool(), logprobs.detach(), fill).requires_grad_()
        loss = policy_loss_at_defaults(kind, padded, torch.where(mask.bool(), old, fill), advantages, mask)
        results.append((loss, torch.autograd.grad(loss, padded)[0]))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("flags,words", [
    ({"advantage_estimator": "gae"}, "gmpo takes one advantage per response and gae's advantages differ token by"),
    ({"teacher_pretrain": "teacher"}, "and --teacher_pretrain adds a distillation reward of its own to each token"),
    ({"advantage_estimator": "rloo"}, "and --advantage_estimator rloo puts the KL penalty (--init_kl_coef 0.01)"),
    ({"gamma": 0.9}, "and --gamma 0.9 discounts the reward differently for each token"),
])
def test_gmpo_with_per_token_advantages_is_refused_in_one_sentence(flags, words):
    """GMPO has no token-level form: where advantages differ within a response, averaging them would silently
    collapse the per-token signal, so the run is refused (GSPO takes them, as GSPO-token)."""
    args = ppo_ray.Args(**{"pretrain": "unused", "reward_fn": "unused.py:f", "policy_loss": "gmpo",
                           "advantage_estimator": "grpo", "n_samples_per_prompt": 2, **flags})
    with pytest.raises(UserError, match=re.escape(words)):
        ppo_ray.check_args(args)
    args.policy_loss = "gspo"
    with pytest.raises(UserError, match="does not exist"):  # gspo passes every flag check, on to the model path
        ppo_ray.check_args(args)


@pytest.mark.parametrize("flags,words", [
    ({"kl_estimator": "k3-unbiased", "advantage_estimator": "rloo"}, "--kl_estimator k3-unbiased weighs k3 by pi"),
    ({"off_policy_seq_mask": -0.1}, "--off_policy_seq_mask -0.1 would mask responses the sampler agrees with"),
    ({"vllm_rs_threshold": 0.99}, "seq-mask-tis's band [--vllm_rs_threshold_lower 0.999, --vllm_rs_threshold 0.99]"),
    ({"vllm_is_kind": "icepop", "vllm_is_cap": 0.8}, "--vllm_is_cap 0.8 would down-weight"),
])
def test_the_new_flags_out_of_range_are_refused_in_one_sentence(flags, words):
    args = ppo_ray.Args(**{"pretrain": "unused", "reward_fn": "unused.py:f", "advantage_estimator": "grpo",
                           "n_samples_per_prompt": 2, **flags})
    with pytest.raises(UserError, match=re.escape(words)):
        ppo_ray.check_args(args)


# ----------------------------------------------------------------------------------------------- rollout corrections
def correction_batch():
    """pi_old / pi_vllm per token: response 0 agrees with vLLM to 1e-4 nats a token; response 1 holds ratios 0.3, 1,
    4 and 7; response 2 a mean log-ratio of +0.01 (a geometric mean of 1.01); response 3 ratios 1.5 and 0.6."""
    mask = (torch.arange(SEQ)[None] < torch.tensor([3, 4, 5, 2])[:, None]).float()
    log_ratio = torch.zeros(4, SEQ)
    log_ratio[0, :3] = torch.tensor([1e-4, -1e-4, 5e-5])
    log_ratio[1, :4] = torch.log(torch.tensor([0.3, 1.0, 4.0, 7.0]))
    log_ratio[2, :5] = torch.tensor([0.03, -0.01, 0.02, 0.0, 0.01])
    log_ratio[3, :2] = torch.log(torch.tensor([1.5, 0.6]))
    vllm = -torch.rand(4, SEQ, generator=torch.Generator().manual_seed(9))
    old = torch.where(mask.bool(), vllm + log_ratio, GARBAGE)
    return old, vllm, mask, log_ratio


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_each_rollout_correction_at_its_defaults(kind):
    """TIS (Yao et al. 2025): min(ratio, 2). IcePop (Ling team 2025): the ratio itself inside [0.5, 5], 0 outside.
    Sequence-masked TIS: min(ratio, 2), and a response whose geometric-mean ratio leaves verl's [0.999, 1.001] is
    left out whole. The metric is the share of valid tokens capped (tis) or left out."""
    old, vllm, mask, log_ratio = correction_batch()
    args = ppo_ray.Args(vllm_is_correction=True, vllm_is_kind=kind)
    weights, metrics = ppo_ray.vllm_correction(args, old, vllm, mask)
    expected, hit = torch.zeros(4, SEQ), 0
    for i in range(4):
        n = int(mask[i].sum())
        geometric = math.exp(sum(log_ratio[i, t].item() for t in range(n)) / n)
        for t in range(n):
            ratio = math.exp(log_ratio[i, t].item())
            if kind == "tis":
                expected[i, t], hit = min(ratio, 2.0), hit + (ratio > 2.0)
            elif kind == "icepop":
                inside = 0.5 <= ratio <= 5.0
                expected[i, t], hit = (ratio if inside else 0.0), hit + (not inside)
            else:
                inside = 0.999 <= geometric <= 1.001
                expected[i, t], hit = (min(ratio, 2.0) if inside else 0.0), hit + (not inside)
    torch.testing.assert_close(weights, expected)
    assert list(metrics.values())[0].item() == pytest.approx(hit / mask.sum().item())


# ----------------------------------------------------------------------------------------------- advantages
def advantage_batch():
    """Two prompts x two samples of 3, 5, 2 and 4 tokens, scores 1, 0, 0.5, 0.5 (the second group has no spread),
    a per-token KL estimate and a critic's values."""
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 5, 2, 4]
    mask = (torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None]).float()
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    kl = torch.where(mask.bool(), 0.3 * torch.randn(4, SEQ, generator=gen), GARBAGE)
    values = torch.where(mask.bool(), torch.randn(4, SEQ, generator=gen), GARBAGE)
    return lengths, mask, scores, kl, values


def whiten(per_token: dict) -> dict:
    """Batch whitening over every valid token: mean 0, Bessel-corrected variance 1 (+1e-8)."""
    values = list(per_token.values())
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return {k: (v - mean) / math.sqrt(var + 1e-8) for k, v in per_token.items()}


@pytest.mark.parametrize("estimator", ["gae", "reinforce++", "reinforce++-baseline", "grpo", "dr_grpo", "rloo"])
def test_each_advantage_estimator_at_its_defaults(estimator):
    """gae (Schulman et al. 2016): delta_t = r_t + V_{t+1} - V_t, A_t = delta_t + 0.95 A_{t+1}, whitened.
    reinforce++ (Hu et al. 2025): the return of the reward (-beta KL per token, the score on the last), whitened;
    -baseline: the score minus its group's mean first. grpo (Shao et al. 2024): (score - group mean) / (group std
    + 1e-6) on every token; dr_grpo (Liu et al. 2025): the same without the std. rloo (Ahmadian et al. 2024): the
    score minus the mean of the group's others, then the return, not whitened. gamma 1 throughout."""
    lengths, mask, scores, kl, values = advantage_batch()
    beta = 0.05
    args = ppo_ray.Args(advantage_estimator=estimator, n_samples_per_prompt=2)
    advantages, _ = ppo_ray.compute_advantages(args, scores, kl, values, mask, beta)
    s = scores.tolist()
    groups = [[s[0], s[1]], [s[2], s[3]]]
    expected = {}
    for i, n in enumerate(lengths):
        group, other = groups[i // 2], s[i ^ 1]
        mean = sum(group) / 2
        if estimator in ("grpo", "dr_grpo"):
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / 1)
            a = (s[i] - mean) / (std + 1e-6) if estimator == "grpo" else s[i] - mean
            expected.update({(i, t): a for t in range(n)})
            continue
        score = {"rloo": s[i] - other, "reinforce++-baseline": s[i] - mean}.get(estimator, s[i])
        reward = [-beta * kl[i, t].item() + (score if t == n - 1 else 0.0) for t in range(n)]
        if estimator == "gae":
            v = [values[i, t].item() for t in range(n)] + [0.0]
            running = 0.0
            for t in reversed(range(n)):
                running = reward[t] + v[t + 1] - v[t] + 0.95 * running
                expected[(i, t)] = running
        else:
            expected.update({(i, t): sum(reward[t:]) for t in range(n)})
    if estimator in ("gae", "reinforce++", "reinforce++-baseline"):
        expected = whiten(expected)
    reference = torch.zeros(4, SEQ)
    for (i, t), a in expected.items():
        reference[i, t] = a
    torch.testing.assert_close(torch.where(mask.bool(), advantages, 0.0), reference, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- DeepSeek-V3.2
def test_the_importance_weighted_k3_is_unbiased_off_policy_in_value_and_gradient():
    """DeepSeek-V3.2 (2025, "Unbiased KL Estimate"): over tokens drawn from pi_old, E[pi / pi_old k3] is
    KL(pi || pi_ref) exactly, and so is its gradient; plain k3 over the same draws is off. Worked on categoricals of
    5 tokens by summing over every token rather than sampling."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(5, generator=gen, requires_grad=True)
    pi_log, old_log, ref_log = (torch.log_softmax(x, -1) for x in (logits, torch.randn(5, generator=gen),
                                                                    torch.randn(5, generator=gen)))
    exact = (pi_log.exp() * (pi_log - ref_log)).sum()
    old_weight = old_log.exp()
    unbiased = (old_weight * ppo_tricks.kl_penalty(pi_log, ref_log, "k3-unbiased", old_logprobs=old_log)).sum()
    plain = (old_weight * ppo_tricks.kl_penalty(pi_log, ref_log, "k3")).sum()
    torch.testing.assert_close(unbiased, exact)
    (grad_exact,) = torch.autograd.grad(exact, logits, retain_graph=True)
    (grad_unbiased,) = torch.autograd.grad(unbiased, logits, retain_graph=True)
    torch.testing.assert_close(grad_unbiased, grad_exact)
    assert abs((plain - exact).item()) > 1e-2


def test_the_importance_weighted_k3_worked_by_hand():
    """log pi = -1, log pi_ref = -1.5, log pi_old = -1.2: k3 = e^-0.5 - 1 + 0.5 = 0.10653, times pi / pi_old = e^0.2
    gives 0.13012; its derivative in log pi is r (k3 + 1 - e^-0.5) = 0.60952. Without pi_old it is k3."""
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    ref, old = torch.tensor([[-1.5]]), torch.tensor([[-1.2]])
    value = ppo_tricks.kl_penalty(logprobs, ref, "k3-unbiased", torch.ones(1, 1), old)
    value.sum().backward()
    assert value.item() == pytest.approx(math.exp(0.2) * (math.exp(-0.5) - 0.5), rel=1e-5)
    assert logprobs.grad.item() == pytest.approx(math.exp(0.2) * (math.exp(-0.5) - 0.5 + 1 - math.exp(-0.5)), rel=1e-5)
    assert ppo_tricks.kl_penalty(logprobs, ref, "k3-unbiased").item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-5)


def test_off_policy_sequence_masking_worked_by_hand():
    """DeepSeek-V3.2 (2025, "Off-Policy Sequence Masking"), delta 0.3: a response of A < 0 whose sampler is 0.5 nats
    a token above the policy leaves the loss; the same drift with A > 0 stays, and so does A < 0 at a drift of 0.1.
    The loss still divides by every token (the paper's 1 / |o|): the masked response's tokens count as zeros."""
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    logprobs = torch.full((3, 3), -1.0, requires_grad=True)
    sampler = logprobs.detach() + torch.tensor([[0.5], [0.5], [0.1]])
    advantages = torch.tensor([[-1.0], [1.0], [-1.0]]).expand(3, 3) * mask
    keep = ppo_tricks.off_policy_sequence_mask(logprobs, sampler, advantages, mask, 0.3)
    assert keep[:, 0].tolist() == [0.0, 1.0, 1.0]
    assert ppo_tricks.off_policy_sequence_mask(logprobs, sampler, advantages, mask, None) is None
    loss = policy_loss_at_defaults("ppo", logprobs, logprobs.detach(), advantages, mask, weights=keep)
    loss.backward()
    assert loss.item() == pytest.approx(-(3 * 1.0 + 1 * -1.0) / 6)  # on policy, J_t = A_t
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0, 0], [-1 / 6] * 3, [1 / 6, 0, 0]]))


# ----------------------------------------------------------------------------------------------- preference losses
def pairs():
    """Five pairs' summed log-probs (chosen, rejected) and the reference's, with margins of both signs."""
    gen = torch.Generator().manual_seed(13)
    chosen, rejected = (-torch.rand(5, generator=gen) * 20).requires_grad_(), (-torch.rand(5, generator=gen) * 20)
    rejected.requires_grad_()
    ref_chosen, ref_rejected = -torch.rand(5, generator=gen) * 20, -torch.rand(5, generator=gen) * 20
    return chosen, rejected, ref_chosen, ref_rejected


def log1p_exp(x):
    """-log sigmoid(-x) = log(1 + e^x), written without F.logsigmoid."""
    return torch.log1p(torch.exp(x))


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0),
                                                 ("robust", 0.1)])
def test_each_dpo_loss_against_its_paper(loss_type, smoothing):
    """h = (log pi_w - log ref_w) - (log pi_l - log ref_l). DPO: log(1 + e^(-beta h)), cDPO its label-smoothed mix;
    IPO: (h - 1 / (2 beta))^2; SLiC hinge: max(0, 1 - beta h); rDPO: ((1 - e) l(h) - e l(-h)) / (1 - 2e)."""
    chosen, rejected, ref_chosen, ref_rejected = pairs()
    beta, e = 0.1, smoothing
    losses, chosen_rewards, rejected_rewards = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, e,
                                                            loss_type)
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    forward, backward = log1p_exp(-beta * h), log1p_exp(beta * h)  # -log sigmoid(beta h), -log sigmoid(-beta h)
    reference = {"sigmoid": (1 - e) * forward + e * backward, "ipo": (h - 1 / (2 * beta)) ** 2,
                 "hinge": torch.clamp(1 - beta * h, min=0),
                 "robust": ((1 - e) * forward - e * backward) / (1 - 2 * e)}[loss_type]
    torch.testing.assert_close(losses, reference)
    grads = torch.autograd.grad(losses.sum(), (chosen, rejected), retain_graph=True)
    expected = torch.autograd.grad(reference.sum(), (chosen, rejected))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(chosen_rewards, beta * (chosen - ref_chosen).detach())
    torch.testing.assert_close(rejected_rewards, beta * (rejected - ref_rejected).detach())


def test_simpo_and_orpo_as_preference_losses_gives_them_against_their_papers():
    """SimPO (Meng et al. 2024, eq. 6): log(1 + e^-(beta/|y_w| log pi_w - beta/|y_l| log pi_l - gamma)). ORPO (Hong
    et al. 2024, eqs. 4-7): lambda log(1 + e^-(log odds_w - log odds_l)), odds = P / (1 - P) of P = e^(mean log pi)."""
    chosen, rejected, _, _ = pairs()
    lengths = (torch.tensor([3.0, 7, 12, 20, 5]), torch.tensor([9.0, 2, 12, 25, 30]))
    simpo = dpo.Args(loss_type="simpo", beta=2.0, simpo_gamma=0.5)
    losses, _, _ = dpo.preference_losses(simpo, chosen, rejected, None, lengths)
    reference = log1p_exp(-(2.0 * chosen / lengths[0] - 2.0 * rejected / lengths[1] - 0.5))
    torch.testing.assert_close(losses, reference)
    orpo = dpo.Args(loss_type="orpo", beta=0.1)
    losses, _, _ = dpo.preference_losses(orpo, chosen, rejected, None, lengths)
    p_w, p_l = torch.exp(chosen / lengths[0]), torch.exp(rejected / lengths[1])
    reference = 0.1 * log1p_exp(-(torch.log(p_w / (1 - p_w)) - torch.log(p_l / (1 - p_l))))
    torch.testing.assert_close(losses, reference)
    grads = torch.autograd.grad(losses.sum(), (chosen, rejected), retain_graph=True)
    for got, want in zip(grads, torch.autograd.grad(reference.sum(), (chosen, rejected))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("loss_type,nll_loss_coef,weight", [("orpo", 0.0, 1.0), ("sigmoid", 0.0, 0.0),
                                                            ("sigmoid", 0.2, 0.2)])
def test_orpos_objective_holds_the_chosen_responses_nll_at_weight_one(loss_type, nll_loss_coef, weight):
    """ORPO is L_SFT + lambda L_OR (Hong et al. 2024): the chosen responses' NLL per token at weight 1, where
    DPO has it only at --nll_loss_coef (Pang et al. 2024)."""
    chosen = torch.tensor([-6.0, -9.0], requires_grad=True)
    args = dpo.Args(loss_type=loss_type, nll_loss_coef=nll_loss_coef)
    nll = dpo.nll_term(args, chosen, torch.tensor(5.0))
    assert nll.item() == pytest.approx(weight * 15.0 / 5)
    if weight:
        nll.backward()
        torch.testing.assert_close(chosen.grad, torch.full((2,), -weight / 5))


def test_kto_loss_against_its_paper():
    """KTO (Ethayarajh et al. 2024, sec. 4): lambda_D (1 - sigmoid(beta (r - z0))) for desirable responses,
    lambda_U (1 - sigmoid(beta (z0 - r))) for undesirable ones, r = log pi - log ref."""
    chosen, _, ref, _ = pairs()
    labels = torch.tensor([True, False, True, False, False])
    beta, z0, lambda_d, lambda_u = 0.1, 0.7, 1.0, 1.33
    losses, rewards = kto_loss(chosen, ref, labels, z0, beta, lambda_d, lambda_u)
    r = chosen - ref
    reference = torch.where(labels, lambda_d * (1 - 1 / (1 + torch.exp(-beta * (r - z0)))),
                            lambda_u * (1 - 1 / (1 + torch.exp(-beta * (z0 - r)))))
    torch.testing.assert_close(losses, reference)
    (grad,) = torch.autograd.grad(losses.sum(), chosen, retain_graph=True)
    torch.testing.assert_close(grad, torch.autograd.grad(reference.sum(), chosen)[0])
    torch.testing.assert_close(rewards, beta * r.detach())


def test_reward_model_loss_against_bradley_terry():
    """rm.py (Ouyang et al. 2022, eq. 1): log(1 + e^-(r_w - r_l - m)) per pair, with and without a margin m."""
    chosen, rejected, margin, _ = pairs()
    for m in (None, margin / 10):
        losses = pairwise_loss(chosen, rejected, m)
        reference = log1p_exp(-(chosen - rejected - (0.0 if m is None else m)))
        torch.testing.assert_close(losses, reference)
        grads = torch.autograd.grad(losses.sum(), (chosen, rejected), retain_graph=True)
        for got, want in zip(grads, torch.autograd.grad(reference.sum(), (chosen, rejected))):
            torch.testing.assert_close(got, want)


def test_dpo_at_its_defaults_is_dpo():
    """dpo.py named alone: the sigmoid loss, no label smoothing, beta 0.1 (Rafailov et al. 2023)."""
    args = dpo.Args()
    assert (args.loss_type, args.label_smoothing, args.nll_loss_coef, args.beta) == ("sigmoid", 0.0, 0.0, 0.1)
