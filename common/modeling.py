"""What every script computes from a causal LM's logits: per-token log-probs, masked sums, entropy."""

import functools
import inspect

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | ...) for each position; logits (batch, seq, vocab), labels (batch, seq) -> (batch, seq).

    Computed as logit - logsumexp in float32 so bf16 logits do not lose the small differences PPO ratios need.
    """
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def within_sampling_support(logits: torch.Tensor, labels: torch.Tensor, top_p: float) -> torch.Tensor:
    """The logits with every token outside vLLM's top-p support at the float minimum, so that a softmax of them is
    the distribution vLLM sampled from: (batch, seq, vocab), labels (batch, seq).

    DeepSeek-V3.2's "keep sampling mask": vLLM draws from the smallest set of tokens, by probability, whose mass
    reaches top_p, renormalised, and with logprobs_mode processed_logprobs returns log-probs of that distribution.
    The support is rebuilt here from these logits by vLLM's rule (sorted ascending, a token dropped while the mass up
    to and including it is at most 1 - top_p, the most likely token always kept) rather than carried from the
    engine: a vocabulary-wide mask per token would cost vocab / 8 bytes a token (19 KB at 150k), and the rebuilt one
    differs from vLLM's only where a token sits on the boundary within rounding. The sampled token (`labels`) always
    stays in, so that its log-prob is finite when the update's policy has moved its support.
    """
    with torch.no_grad():
        ascending, order = logits.sort(dim=-1)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # (batch, seq, vocab) in ascending order
        dropped[..., -1] = False
        outside = torch.zeros_like(dropped).scatter_(-1, order, dropped)
        outside.scatter_(-1, labels.unsqueeze(-1), False)
    return logits.masked_fill(outside, torch.finfo(logits.dtype).min)


def next_token_logprobs(model, input_ids, attention_mask=None, position_ids=None, start: int = 0,
                        **inputs) -> torch.Tensor:
    """Log-prob of each token given the ones before it: (batch, seq - 1), entry t is for token t + 1; 0 before entry
    `start`, whose logits next_token_logits skips (response_start of the loss mask: the prompts need none). `inputs`
    go to the forward as they are: a vision-language model's pixel values (common/vlm.py image_inputs)."""
    # (batch, seq - 1 - start, vocab)
    logits = next_token_logits(model, input_ids, attention_mask, position_ids, start, **inputs)
    return F.pad(token_logprobs(logits, input_ids[:, start + 1:]), (start, 0))


def next_token_logits(model, input_ids, attention_mask=None, position_ids=None, start: int = 0,
                      **inputs) -> torch.Tensor:
    """The logits that predict tokens start + 1 .. seq - 1, each from the positions before it: (batch, seq - 1 -
    start, vocab), entry t for token start + t + 1.

    Where the model's forward takes `logits_to_keep` (transformers' causal LMs do), its LM head runs on those
    positions only. A PPO batch's prompt columns (response_start) need no logits, and at a vocabulary of 150k their
    float32 logits and log-softmax are the largest tensors of a step. Other models compute every position's logits
    and the ones before `start` are dropped.
    """
    kept = input_ids.shape[1] - start  # the last positions, whose logits are needed (the very last predicts nothing)
    keep = {"logits_to_keep": kept} if start and takes_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   **keep, **inputs).logits  # (batch, seq or kept, vocab)
    return logits[:, -kept:-1]


def response_start(action_mask: torch.Tensor) -> int:
    """The first column of a (batch, seq - 1) next-token mask that is 1 in some row: no logits before it are used
    (0 when no column is)."""
    columns = action_mask.any(0).nonzero()
    return int(columns[0]) if len(columns) else 0


def takes_logits_to_keep(model) -> bool:
    """Whether the causal LM under a DeepSpeed engine (`.module`) and a peft wrapper takes `logits_to_keep`."""
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):  # peft's PeftModel, whose forward passes its keyword arguments on
        model = model.get_base_model()
    return _forward_takes(type(model), "logits_to_keep")


@functools.cache
def _forward_takes(model_class: type, name: str) -> bool:
    return name in inspect.signature(model_class.forward).parameters


def sequence_sums(values: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum next-token values (entry t is for token t + 1) over each sequence: (rows, seq - 1) -> (sequences,).

    Padded rows (no position_ids) are one sequence each. A packed (1, total) row (common/data.py pack_collate) is cut
    where its position_ids restart at 0; the entry that predicts a sample's first token from the previous sample's
    last one crosses the boundary and is dropped (a sample's first token is never in the loss mask either).
    """
    if position_ids is None:
        return values.sum(-1)
    starts = position_ids[0] == 0  # (total,)
    sample = starts.long().cumsum(0)[1:] - 1  # (total - 1,): the sample of the token each entry predicts
    inside = values[0].masked_fill(starts[1:], 0)
    return inside.new_zeros(int(starts.sum())).index_add(0, sample, inside)


def packed_sample_ends(position_ids: torch.Tensor) -> torch.Tensor:
    """The index of each sample's last token in a packed (1, total) row whose position_ids restart at 0: (samples,)."""
    starts = (position_ids[0] == 0).nonzero().squeeze(-1)  # (samples,)
    return torch.cat([starts[1:] - 1, starts.new_tensor([position_ids.shape[1] - 1])])


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A padded (batch, seq) batch as one packed row: (ids (1, total), position_ids (1, total), index (total,)).

    A row's real tokens are where attention_mask is 1, one span however it is padded (ppo_ray.py's build_batch pads
    on the right, OpenRLHF left-pads prompts and right-pads responses); they are packed in order, row after row. The
    position_ids count from 0 in each row, as the padded batch's do, so that each sequence attends to itself only
    (common/data.py pack_collate). `index` is where each packed token sits in the flattened padded batch: unpack and
    unpack_next_token put per-token results back there.
    """
    index = attention_mask.flatten().nonzero().squeeze(-1)  # (total,)
    position_ids = (attention_mask.long().cumsum(-1) - 1).flatten()[index]  # (total,)
    return input_ids.flatten()[index][None], position_ids[None], index


def unpack(values: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """Per-token results of a packed (1, total) row in the padded (batch, seq) layout pack_rows took it from, 0 at
    the padding; gradients flow back to `values`."""
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, index, values[0]).view(shape)  # (batch, seq)


def unpack_next_token(values: torch.Tensor, position_ids: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """Next-token results of a packed row, (1, total - 1) with entry k for token k + 1, in the padded layout
    (batch, seq - 1) with entry t for token t + 1, 0 at the padding.

    An entry whose next token starts a sequence was computed from the previous sequence's last token: nothing in the
    padded layout corresponds to it (there that entry predicts padding, or does not exist), so it becomes a 0, as
    the padding does, and nothing of one sequence reaches another's entries.
    """
    crossing = position_ids[0, 1:] == 0  # (total - 1,)
    at_token = torch.cat([values[0].masked_fill(crossing, 0), values.new_zeros(1)])  # (total,): entry k at token k
    return unpack(at_token[None], index, shape)[:, :-1]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: (batch, seq, vocab) -> (batch, seq)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ------------------------------------------------------------------------------------------------ reward models
def sequence_rewards(model, input_ids, attention_mask, normalize: bool = False, **inputs) -> torch.Tensor:
    """The scalar reward of each sequence, read at its last real token (the EOS rm.py trains on): (batch,).

    `model` is an AutoModelForSequenceClassification with num_labels=1, as rm.py saves it. The score head is applied
    to the final hidden state at each row's last attended position, left or right padded. transformers' own pooling
    reads the rightmost token that is not config.pad_token_id: a reward model trained elsewhere whose padding id is
    its EOS (many Llama-family tokenizers have no pad token) would be read at the token before that EOS. `normalize`
    applies the reward mean and std that rm.py stores in the config. `inputs` go to the forward as they are: a
    vision-language reward model's pixel values (common/vlm.py sequence_classification_class).
    """
    base, _, head = scalar_head_parts(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding keeps positions from 0
    hidden = final_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, **inputs)  # (batch, seq, hidden)
    last = attention_mask.shape[1] - 1 - attention_mask.long().flip(-1).argmax(-1)  # (batch,)
    rewards = head(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1).float()
    return normalize_reward(rewards, base.config) if normalize else rewards


def normalize_reward(rewards: torch.Tensor, config) -> torch.Tensor:
    """(rewards - reward_mean) / reward_std with the statistics rm.py stores in the reward model's config."""
    return (rewards - config.reward_mean) / config.reward_std


def packed_sequence_rewards(model, input_ids, position_ids, **inputs) -> torch.Tensor:
    """The scalar reward of each sample of a packed (1, total) row, read at the sample's own last token: (samples,).

    transformers' sequence-classification pooling reads one position per row, so the score head is applied again to
    the final hidden states at each sample's last position: the state sequence_rewards reads in a padded batch (the
    position_ids restarting at 0 keep each sample attending to itself only), so the rewards are the same. The model
    is called whole, through a DeepSpeed engine's forward (final_hidden_states says why).
    """
    hidden = final_hidden_states(model, input_ids=input_ids, position_ids=position_ids, **inputs)  # (1, total, hidden)
    _, _, head = scalar_head_parts(model)
    return head(hidden[0, packed_sample_ends(position_ids)]).squeeze(-1).float()


def scalar_head_parts(model):
    """(model, backbone, head) of an AutoModelForSequenceClassification, also under a DeepSpeed engine (`.module`)
    and a peft wrapper (`get_base_model()`, whose layers keep their adapters).

    The backbone and the head are called as modules, so ZeRO-3's hooks gather their weights and a head that peft
    wraps (a trained copy behind ModulesToSaveWrapper) computes as itself.
    """
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):  # peft's PeftModel
        model = model.get_base_model()
    backbone = getattr(model, model.base_model_prefix)
    return model, backbone, model.score if hasattr(model, "score") else model.classifier


# ----------------------------------------------------------------------------------------------------- critics
def token_values(model, input_ids, attention_mask, normalize: bool = False, **inputs) -> torch.Tensor:
    """A value for every position: the sequence-classification head applied to each hidden state, (batch, seq).

    `model` is an AutoModelForSequenceClassification with num_labels=1 (a reward model, or a fresh head on the
    policy), so a critic initialised from the reward model starts out predicting its scores. `normalize` puts the
    values on the scale of normalised rewards with the reward mean and std rm.py stored, as OpenRLHF's critic does:
    the rewards PPO trains on are normalised, and a critic left on the raw scale would spend many value-clipped
    steps catching up. `inputs`: a vision-language critic's pixel values, as for sequence_rewards.
    """
    base, _, head = scalar_head_parts(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = final_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, **inputs)  # (batch, seq, hidden)
    values = head(hidden).squeeze(-1).float()
    return normalize_reward(values, base.config) if normalize else values


def final_hidden_states(model, **inputs) -> torch.Tensor:
    """The last layer's hidden states, after the final norm, of a model called whole: (batch, seq, hidden).

    Whole, through a DeepSpeed engine's forward and not its backbone alone: the engine prepares ZeRO's gradient
    accumulation in its forward (the output hooks that run _backward_prologue, deepspeed/runtime/engine.py). Under
    ZeRO-3 a critic update whose forwards bypassed it came out different from the same update under ZeRO-0 once a
    step accumulated two micro-batches (tests/test_gradient_accumulation.py). output_hidden_states names the last
    layer alone, so transformers keeps no other layer's states (a vision-language model's: its language model's).
    """
    last_layer = scalar_head_parts(model)[0].config.get_text_config().num_hidden_layers - 1
    return model(**inputs, output_hidden_states=[last_layer], use_cache=False).hidden_states[-1]


def packed_token_values(model, input_ids, position_ids, normalize: bool = False, **inputs) -> torch.Tensor:
    """token_values for a packed (1, total) row whose position_ids restart at 0 at each sequence: (1, total).
    `inputs`: a vision-language critic's image inputs of the packed row (common/vlm.py packed_image_inputs)."""
    base, _, head = scalar_head_parts(model)
    hidden = final_hidden_states(model, input_ids=input_ids, position_ids=position_ids, **inputs)  # (1, total, hidden)
    values = head(hidden).squeeze(-1).float()
    return normalize_reward(values, base.config) if normalize else values


# ------------------------------------------------------------------------------------------- mixture of experts
def keep_router_loss(model) -> bool:
    """Keep the load-balancing loss of each training forward of a mixture-of-experts `model` whose config asks for
    it (`output_router_logits: true`), for router_loss to add to the trainer's loss; returns whether it does.

    transformers computes that loss (Switch Transformer's, Fedus et al. 2021, eq. 4) in every forward of such a model
    but adds it to the loss only when given labels, which the trainers never pass: they compute their own losses
    from the logits.
    """
    model = getattr(model, "module", model)
    model = model.get_base_model() if hasattr(model, "peft_config") else model
    if not getattr(model.config, "output_router_logits", False):
        return False

    def keep(module, args, output):
        aux = getattr(output, "aux_loss", None)
        if aux is not None and torch.is_grad_enabled() and module.training:  # evaluation forwards keep nothing
            module.__dict__.setdefault("_router_losses", []).append(aux)

    model.register_forward_hook(keep)
    return True


def router_loss(model) -> torch.Tensor | float:
    """router_aux_loss_coef x the mean load-balancing loss of the training forwards since the last call (0.0 for a
    model that keeps none, see keep_router_loss). A trainer adds it to each micro-batch's loss: DeepSpeed's average
    over micro-batches and ranks then makes it the step's mean."""
    model = getattr(model, "module", model)
    model = model.get_base_model() if hasattr(model, "peft_config") else model
    losses = model.__dict__.pop("_router_losses", None)
    if not losses:
        return 0.0
    return getattr(model.config, "router_aux_loss_coef", 0.0) * torch.stack(losses).mean()
