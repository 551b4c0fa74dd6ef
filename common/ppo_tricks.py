"""The shared PPO tricks as pure tensor functions: GAE, KL estimators and controllers, masked whitening, reward shaping.

Every function takes a `mask` of shape (batch, seq), bool or 0/1, that marks response tokens. Masked-out positions
never enter a statistic, come back as 0, and may hold anything (padding, garbage, even NaN) without changing the result.
Nothing divides by an empty count: a statistic over no tokens is 0.

    - compute_gae / compute_returns           advantages and returns (Schulman et al. 2016, GAE)
    - kl_penalty                              per-token KL estimators k1, k2, k3 (http://joschu.net/blog/kl-approx.html)
                                              and DeepSeek-V3.2's importance-weighted k3
    - off_policy_sequence_mask                DeepSeek-V3.2's off-policy sequence masking
    - clip_range / default_loss_agg / vllm_is_band  each option's paper's settings where the user gave none
    - FixedKLController / AdaptiveKLController  the KL coefficient (Ziegler et al. 2019)
    - uses_reference                          whether a run has a reference model at all (a KL coefficient above 0)
    - masked_mean / masked_var / masked_whiten
    - aggregate                               a per-token loss to a scalar: DAPO, GRPO, Dr. GRPO
    - place_reward_on_eos / compute_token_rewards
    - overlong_penalty                        DAPO's soft penalty on responses near the length limit
    - group_advantages                        critic-free baselines: GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline
"""

import torch

# Added to the variance before the square root, so whitening a constant tensor gives zeros, not NaN.
WHITEN_EPS = 1e-8
# Every log-ratio that reaches an exp is kept within +-20 nats (as verl does): exp(89) overflows float32, and an inf
# on one valid token makes the whole gradient NaN; no real update moves a token's probability e^20-fold.
MAX_LOG_RATIO = 20.0


# ----------------------------------------------------------------------------------------------- masked statistics
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is set, over all of them or along `dim`; 0 where none is set."""
    mask = mask.bool()
    # torch.where, not values * mask: NaN or inf in padding would survive a multiplication by 0.
    total = torch.where(mask, values, 0.0).sum(dim=dim)
    count = mask.sum(dim=dim)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected variance of `values` over all masked positions; 0 for fewer than 2 tokens."""
    mask = mask.bool()
    centered = torch.where(mask, values - masked_mean(values, mask), 0.0)
    return centered.square().sum() / (mask.sum() - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalise the masked entries of `values` to mean 0 and variance 1; masked-out positions come back as 0.

    ppo_ray.py whitens gae and reinforce++ advantages with it over the whole batch, on the driver.
    """
    mask = mask.bool()
    whitened = (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    return torch.where(mask, whitened, 0.0)


def response_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of one value per response, (batch,), over the responses with a masked token: one --overlong_filter
    took out counts for nothing."""
    has_tokens = mask.bool().any(-1)
    return torch.where(has_tokens, values, 0.0).sum() / has_tokens.sum().clamp(min=1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int = 1,
              count: torch.Tensor | float | None = None) -> torch.Tensor:
    """A per-token loss (batch, seq) as one number, by how much each token and each sequence weighs.

    - "token-mean": the mean over every masked token of the batch: each token weighs the same, so a long response
      weighs more than a short one (DAPO, Yu et al. 2025).
    - "seq-mean-token-mean": each sequence's token mean, then the mean over sequences: each response weighs the
      same, its tokens less the longer it is (GRPO as written, Shao et al. 2024).
    - "seq-mean-token-sum-norm": each sequence's token sum over the constant `max_len`, then the mean over
      sequences: no length normalisation, which with GRPO's favours long wrong answers (Dr. GRPO, Liu et al. 2025).

    A sequence with no masked token (one --overlong_filter took out) is not counted in a mean over sequences.
    `count`: where `loss` is one micro-batch of a larger batch, that batch's aggregate_count; the micro-batch then
    gives its share of the batch's aggregate, and the shares of all its micro-batches add up to it.
    """
    mask = mask.bool()
    if mode == "token-mean":
        total = torch.where(mask, loss, 0.0).sum()
    elif mode == "seq-mean-token-mean":
        total = torch.where(mask.any(-1), masked_mean(loss, mask, dim=-1), 0.0).sum()
    elif mode == "seq-mean-token-sum-norm":
        total = torch.where(mask, loss, 0.0).sum() / max_len
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; use 'token-mean', 'seq-mean-token-mean' or "
                         f"'seq-mean-token-sum-norm'.")
    count = aggregate_count(mask, mode) if count is None else count
    return total / (count.clamp(min=1) if torch.is_tensor(count) else max(count, 1))


def aggregate_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What `aggregate` divides by: the masked tokens for "token-mean", else the responses with a masked token."""
    mask = mask.bool()
    return mask.sum() if mode == "token-mean" else mask.any(-1).sum()


# ----------------------------------------------------------------------------------------------- advantages
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

    rewards, values, mask: (batch, seq). The TD residual and its exponentially weighted sum (eqs. 11-16)

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = sum_l (gamma * lam)^l * delta_{t+l}  =  delta_t + gamma * lam * A_{t+1}

    are computed by the right-hand recursion, backwards over time and vectorised over the batch. Masked-out positions
    are skipped as if absent: their advantage is 0, the step after a sequence's last real token has V = 0 and A = 0
    (the episode ends there), left padding before a response is passed over, and a gap inside a row's mask (the
    environment's tokens between two turns of a multi-turn episode) joins the turns on either side: the last token
    of a turn looks ahead to the first of the next. Returns (advantages, returns), returns = advantages + values
    (the critic's regression target), both 0 where mask is 0. Pass detached values: these are targets.
    """
    mask = mask.bool()
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.where(mask, values, 0.0)
    advantages = torch.zeros_like(values)  # (batch, seq)
    next_value = torch.zeros_like(values[:, 0])  # (batch,)
    next_advantage = torch.zeros_like(values[:, 0])  # (batch,)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(mask[:, t], advantage, 0.0)
        next_value = torch.where(mask[:, t], values[:, t], next_value)  # a masked-out position passes them on
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def compute_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go G_t = r_t + gamma * G_{t+1} per token, (batch, seq), 0 outside the mask.

    Critic-free methods (REINFORCE++, GRPO, RLOO at token level) use it as the advantage; with gamma=1 it is the sum
    of the rewards from t on. It is GAE with V = 0 and lam = 1, where delta_t = r_t.
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)
    return returns


def group_advantages(
    scores: torch.Tensor, n_samples_per_prompt: int, kind: str, eps: float = 1e-6, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Critic-free advantages for a flat (batch,) of scores holding n_samples_per_prompt consecutive samples per prompt.

    - "grpo" (Shao et al. 2024, DeepSeekMath): score minus its group's mean, over the group's std + eps.
    - "mean": score minus its group's mean, not divided by the std, which weighs prompts that are almost always
      (or never) solved more than their signal warrants (Dr. GRPO, Liu et al. 2025); REINFORCE++-baseline's
      baseline (Hu et al. 2025) before its batch whitening.
    - "rloo" (Ahmadian et al. 2024): score minus the mean of the other samples of the same prompt, an unbiased
      baseline because it does not depend on the sample itself; needs at least 2 samples per prompt.

    `keep` (batch,) bool: only these samples count, as if the others had not been sampled (--overlong_filter). The
    group statistics are over a group's kept samples; the others get 0, and so does a kept sample with no other to
    compare with.
    """
    n = n_samples_per_prompt
    if n < 1 or scores.shape[0] % n != 0:
        raise ValueError(
            f"a batch of {scores.shape[0]} scores does not split into groups of n_samples_per_prompt={n}; "
            "make the rollout batch a multiple of n_samples_per_prompt."
        )
    if kind == "rloo" and n < 2:
        raise ValueError("rloo needs n_samples_per_prompt >= 2 to form a leave-one-out baseline; raise it.")
    if kind not in ("grpo", "mean", "rloo"):
        raise ValueError(f"unknown group advantage {kind!r}; use 'grpo', 'mean' or 'rloo'.")
    groups = scores.reshape(-1, n)  # (prompts, n)
    kept = torch.ones_like(groups) if keep is None else keep.reshape(-1, n).to(groups.dtype)
    count = kept.sum(dim=1, keepdim=True)  # (prompts, 1)
    total = (groups * kept).sum(dim=1, keepdim=True)
    mean = total / count.clamp(min=1)
    if kind == "rloo":  # the mean of the group's other kept samples
        advantages = groups - (total - groups) / (count - 1).clamp(min=1)
        advantages = advantages * (count > 1)
    else:
        advantages = groups - mean
    if kind == "grpo":
        # One sample has no spread to divide by: its std is 0 (correction 0), as is its advantage.
        variance = ((groups - mean) ** 2 * kept).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        advantages = advantages / (variance.sqrt() + eps)
    return (advantages * kept).reshape(-1)


def groups_with_a_spread(scores: torch.Tensor, n_samples_per_prompt: int, eps: float = 1e-6) -> torch.Tensor:
    """(prompts,) True where a prompt's n consecutive scores are not all equal (DAPO's dynamic sampling keeps these):
    a group of equal scores gets zero advantages from every group baseline, so it teaches the policy nothing."""
    groups = scores.reshape(-1, n_samples_per_prompt)
    return groups.max(dim=1).values - groups.min(dim=1).values > eps


# ----------------------------------------------------------------------------------------------- KL
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
               mask: torch.Tensor | None = None, old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the log probs of tokens sampled from the policy.

    With log_ratio = logprobs - ref_logprobs (http://joschu.net/blog/kl-approx.html):
    - "k1": log_ratio. Unbiased, high variance, negative on some tokens.
    - "k2": 0.5 * log_ratio^2. Biased, low variance, never negative.
    - "k3": exp(-log_ratio) - 1 + log_ratio. Unbiased, low variance, never negative (r - 1 - log r >= 0 for r > 0).
    - "k3-unbiased": k3 x pi / pi_old, pi_old = exp(old_logprobs), the policy that sampled the tokens (DeepSeek-V3.2,
      2025, "Unbiased KL Estimate"). k3 is unbiased only for tokens the current policy sampled; in a loss after an
      update they came from pi_old, and the ratio (with its gradient) reweighs them to pi. Without `old_logprobs` the
      ratio is 1.
    With a `mask`, the estimate is 0 outside it: k3's exp of whatever padding holds could overflow, and a masked-out
    inf still makes the gradient NaN. Every log-ratio is clamped to +-MAX_LOG_RATIO.
    """
    valid = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask.bool()
    log_ratio = torch.where(valid, logprobs - ref_logprobs, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    k3 = torch.exp(-log_ratio) - 1 + log_ratio
    if kind == "k3":
        return k3
    if kind == "k3-unbiased":
        if old_logprobs is None:
            return k3
        return torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() * k3
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2', 'k3' or 'k3-unbiased'.")


def kl_loss_estimator(args) -> str:
    """The estimator of grpo's and dr_grpo's KL loss term: k3 (DeepSeekMath), or --kl_estimator k3-unbiased."""
    return "k3-unbiased" if args.kl_estimator == "k3-unbiased" else "k3"


def off_policy_sequence_mask(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, delta: float | None, weights: torch.Tensor | None = None):
    """DeepSeek-V3.2's off-policy sequence masking (2025, "Off-Policy Sequence Masking"), all (batch, seq): the
    token weights times

        M_t = 0 where A_t < 0 and (1 / |o|) sum_t log(pi_sampler(o_t) / pi(o_t)) > delta, else 1,

    so a response the sampler has drifted away from by more than delta nats a token cannot push the policy away
    from its own (bad) tokens; positive advantages still teach. The aggregate's count is unchanged, as in the paper's
    1/|o| normalisation. `delta` None: `weights` come back as they are.
    """
    if delta is None:
        return weights
    log_ratio = torch.where(mask.bool(), sampler_logprobs - logprobs.detach(), 0.0)
    drift = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # (batch, 1): KL(sampler || pi) per token
    keep = ~((advantages < 0) & (drift > delta))
    return keep.float() if weights is None else weights * keep


# Advantage estimators that compare the samples of one prompt (they need --n_samples_per_prompt 2 or more).
GROUPED = ("grpo", "dr_grpo", "rloo", "reinforce++-baseline")
KL_IN_LOSS = ("grpo", "dr_grpo")  # estimators whose KL to the reference is a loss term, not a reward penalty


# What each --policy_loss's paper (or, where it is silent, the implementation docs/ppo.md cites) uses for the flags
# the user left out; ppo, and any flag the user gave, keep the shared defaults or what was given.
POLICY_LOSS_DEFAULTS = {
    "gspo": {"eps_clip_low": 3e-4, "eps_clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"},  # GSPO, sec. 5
    "gmpo": {"eps_clip_low": 0.4, "eps_clip_high": 0.4, "loss_agg": "seq-mean-token-mean"},  # GMPO: (e^-0.4, e^0.4)
    "sapo": {"loss_agg": "seq-mean-token-mean"},  # SAPO eq. 5, verl and TRL: each response's token mean
    "cispo": {"eps_clip_high": 4.0},  # MiniMax-M1 tunes only the cap; TRL's epsilon_high 5 is the cap 1 + 4
}
EPS_CLIP = 0.2
VLLM_IS_CAP = {"tis": 2.0, "icepop": 5.0, "seq-mask-tis": 2.0}  # TIS (Yao et al.) 2; IcePop's band is [0.5, 5]


def clip_range(args) -> tuple[float, float]:
    """(low, high): the policy ratio is clipped to [1 - low, 1 + high]: --eps_clip_low/high, else --eps_clip, else
    the --policy_loss's paper's (POLICY_LOSS_DEFAULTS), else 0.2."""
    paper = POLICY_LOSS_DEFAULTS.get(getattr(args, "policy_loss", "ppo"), {})

    def bound(side: str) -> float:
        given = getattr(args, f"eps_clip_{side}")
        if given is not None:
            return given
        return args.eps_clip if args.eps_clip is not None else paper.get(f"eps_clip_{side}", EPS_CLIP)

    return bound("low"), bound("high")


def default_loss_agg(args) -> str:
    """--loss_agg where the user gave none: the --policy_loss's paper's, else Dr. GRPO's unnormalised sequence sums
    for dr_grpo, else DAPO's mean over tokens."""
    paper = POLICY_LOSS_DEFAULTS.get(args.policy_loss, {}).get("loss_agg")
    return paper or ("seq-mean-token-sum-norm" if args.advantage_estimator == "dr_grpo" else "token-mean")


def vllm_is_band(args) -> tuple[float, float, tuple[float, float]]:
    """(floor, cap, sequence band) of pi_trainer / pi_vllm for --vllm_is_kind: --vllm_is_floor, --vllm_is_cap or the
    kind's, and seq-mask-tis's band of a response's geometric-mean ratio, a band of its own (verl keeps them apart)."""
    cap = VLLM_IS_CAP[args.vllm_is_kind] if args.vllm_is_cap is None else args.vllm_is_cap
    return args.vllm_is_floor, cap, (args.vllm_rs_threshold_lower, args.vllm_rs_threshold)


def uses_reference(args) -> bool:
    """Whether a run compares the policy with a reference model: a KL penalty in the reward or in the loss. At
    --init_kl_coef 0 there is none (the adaptive controller scales the coefficient, and 0 stays 0), whatever the
    estimator: ppo_ray.py starts no reference and the memory plan counts none."""
    return args.init_kl_coef > 0


class FixedKLController:
    """A KL coefficient that never changes; update() is there so callers treat both controllers alike."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steer the measured KL towards `target`: the proportional controller of Ziegler et al. 2019, "Fine-Tuning
    Language Models from Human Preferences".

        error = clip(current_kl / target - 1, -0.2, 0.2)
        value = value * (1 + error * n_steps / horizon)

    The clip keeps one outlier batch from swinging the coefficient; `horizon` is the number of samples over which
    the coefficient would change by the full error.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}.")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


# ----------------------------------------------------------------------------------------------- rewards
def place_reward_on_eos(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A (batch, seq) tensor of zeros with each row's scalar score on the last position its mask sets (the EOS).

    The reward model scores whole sequences; PPO with GAE needs a reward per token, and the score belongs to the
    action that ended the sequence. A row whose mask is empty gets no reward.
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device)  # (seq,)
    last = torch.where(mask, positions, -1).max(dim=1).values  # (batch,), -1 for an empty row
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)  # (batch, seq)
    rewards.scatter_(1, last.clamp(min=0)[:, None], scores[:, None])
    return torch.where(mask, rewards, 0.0)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), (batch,) from response lengths in tokens.

    0 up to max_len - buffer_len tokens, then falling linearly to -factor at max_len: a response cut at the limit
    is penalised as a whole, and one that nearly was, a little, so the policy learns to stop before the cut.
    """
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0) / buffer_len
    return -factor * over.clamp(max=1)


def compute_token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards for PPO: -kl_coef * KL on every response token, plus the score on the last one.

    The KL term keeps the policy near the reference model token by token (Ziegler et al. 2019; Stiennon et al. 2020).
    scores (batch,); kl, the per-token estimate from kl_penalty that is also logged as objective/kl, and mask
    (batch, seq). Returns (batch, seq), 0 outside the mask.
    """
    mask = mask.bool()
    return -kl_coef * torch.where(mask, kl, 0.0) + place_reward_on_eos(scores, mask)
