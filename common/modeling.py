"""What every script computes from a causal LM's logits: per-token log-probs, masked sums, entropy."""

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | ...) for each position; logits (batch, seq, vocab), labels (batch, seq) -> (batch, seq).

    Computed as logit - logsumexp in float32 so bf16 logits do not lose the small differences PPO ratios need.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def next_token_logprobs(model, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
    """Log-prob of each token given the ones before it: (batch, seq - 1), entry t is for token t + 1."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # (batch, seq, vocab)
    return token_logprobs(logits[:, :-1], input_ids[:, 1:])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (batch, seq, vocab) -> (batch, seq)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ------------------------------------------------------------------------------------------------ reward models
def sequence_rewards(model, input_ids, attention_mask, normalize: bool = False) -> torch.Tensor:
    """The scalar reward of each sequence, read at its last real token: (batch,).

    `model` is an AutoModelForSequenceClassification with num_labels=1, as rm.py saves it. transformers reads the
    score at the rightmost token that is not config.pad_token_id, so padding (left or right) is rewritten to that id
    here and the last real token, the EOS rm.py trains on, is the one read. `normalize` applies the reward mean and
    std that rm.py stores in the config.
    """
    config = getattr(model, "module", model).config  # a DeepSpeed engine wraps the model
    input_ids = input_ids.masked_fill(attention_mask == 0, config.pad_token_id)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding keeps positions from 0
    scores = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits  # (batch, 1)
    rewards = scores.squeeze(-1).float()
    return normalize_reward(rewards, config) if normalize else rewards


def normalize_reward(rewards: torch.Tensor, config) -> torch.Tensor:
    """(rewards - reward_mean) / reward_std with the statistics rm.py stores in the reward model's config."""
    return (rewards - config.reward_mean) / config.reward_std


# ----------------------------------------------------------------------------------------------------- critics
def token_values(model, input_ids, attention_mask, normalize: bool = False) -> torch.Tensor:
    """A value for every position: the sequence-classification head applied to each hidden state, (batch, seq).

    `model` is an AutoModelForSequenceClassification with num_labels=1 (a reward model, or a fresh head on the
    policy), so a critic initialised from the reward model starts out predicting its scores. `normalize` puts the
    values on the scale of normalised rewards with the reward mean and std rm.py stored, as OpenRLHF's critic does:
    the rewards PPO trains on are normalised, and a critic left on the raw scale would spend many value-clipped
    steps catching up.
    """
    model = getattr(model, "module", model)
    backbone = getattr(model, model.base_model_prefix)
    head = model.score if hasattr(model, "score") else model.classifier
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (batch, seq, hidden)
    values = head(hidden).squeeze(-1).float()
    return normalize_reward(values, model.config) if normalize else values
