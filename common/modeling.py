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
