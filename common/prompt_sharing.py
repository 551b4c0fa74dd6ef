"""--share_prompts: each prompt's tokens computed once for all of its samples in the trainer's forward and backward.

GRPO, RLOO and every group estimator sample n responses to each prompt, and a padded micro-batch computes the prompt
n times over. Here a micro-batch becomes one packed row: each group's prompt once, then its samples' responses, each
response attending to its prompt and to itself only (a (tokens x tokens) mask), and with the position ids it had in
its own row. The log-probs are those of the padded forward up to float rounding, and a backward pass sums the
prompt's gradients over its samples as n separate rows would. Where prompts are long beside their responses, most of
a step's arithmetic goes: the real-model demo's prompts are 42 tokens and its answers 8 to 25 (docs/real_model.md).

The mask is dense: a row of T tokens costs T x T of it, as transformers' sdpa packing does too (common/args.py
check_packing_attention), so this serves short sequences, with sdpa or eager attention (the workers load the policy
with sdpa under --share_prompts: flash-attention's kernels take no such mask). A model whose layers do not read the
mask (recurrent or linear-attention layers) would let the samples read each other: `check_once` compares the first
shared micro-batch against the padded forward and stops the run where they differ. A sliding window is not in the
mask (transformers hands a given 4D mask to its sliding layers as it is): a model whose sliding window is shorter than
its rows can be (--prompt_max_len + --generate_max_len) is refused (check_window); within the window it changes
nothing. A mixture of experts' load-balancing loss counts a shared prompt's tokens once.
"""

import random

import torch

from common.args import UserError
from common.modeling import takes_logits_to_keep


def prompt_lengths(action_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """Each row's prompt: the tokens before its first sampled token (action_mask (rows, seq - 1) is 1 where the next
    token is the policy's); a row with none is prompt alone."""
    acted = action_mask.bool().any(1)
    first = action_mask.float().argmax(1) + 1
    return torch.where(acted, first, attention_mask.sum(1)).tolist()


def groups(batch: dict) -> list[list[int]]:
    """The batch's rows grouped by identical prompt tokens, groups and rows in the order first seen."""
    by_prompt: dict[tuple, list[int]] = {}
    for row, length in enumerate(prompt_lengths(batch["action_mask"], batch["attention_mask"])):
        by_prompt.setdefault(tuple(batch["input_ids"][row, :length].tolist()), []).append(row)
    return list(by_prompt.values())


def group_order(batch: dict, shuffle_seed: int | None = None) -> list[int]:
    """The rows group after group (the groups shuffled by shuffle_seed), so that micro-batches cut from this order
    hold whole groups and share their prompts."""
    found = groups(batch)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(found)
    return [row for group in found for row in group]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, start: int,
         dtype: torch.dtype):
    """A right-padded micro-batch as one row holding each prompt once, then each row's response. Returns
    - ids and position_ids (1, T): a response's positions go on from its prompt's, as in its own row;
    - mask (1, 1, T, T), additive in `dtype`: a prompt token sees its prompt before it, a response token its prompt
      and its own response before it;
    - keep (K,): the packed positions whose logits some row needs (the LM head runs there only);
    - where (rows, seq - 1 - start): for each row's next-token entries start .. seq - 2, the index into `keep` of the
      packed position they are computed at (0 at the row's padding, which the action mask leaves out)."""
    rows, seq = input_ids.shape
    lengths = attention_mask.sum(1).tolist()
    prompts = prompt_lengths(action_mask, attention_mask)
    ids, positions, group_of, row_of = [], [], [], []
    at = torch.zeros(rows, seq, dtype=torch.long)  # where each row's token t sits in the packed row
    seen: dict[tuple, tuple[int, int]] = {}  # prompt tokens -> (group, where its prompt starts)
    for row in range(rows):
        prompt = input_ids[row, :prompts[row]].tolist()
        if tuple(prompt) not in seen:
            seen[tuple(prompt)] = (len(seen), len(ids))
            ids += prompt
            positions += range(len(prompt))
            group_of += [len(seen) - 1] * len(prompt)
            row_of += [-1] * len(prompt)
        group, prompt_at = seen[tuple(prompt)]
        at[row, :prompts[row]] = torch.arange(prompt_at, prompt_at + prompts[row])
        response = input_ids[row, prompts[row]:lengths[row]].tolist()
        at[row, prompts[row]:lengths[row]] = torch.arange(len(ids), len(ids) + len(response))
        ids += response
        positions += range(prompts[row], lengths[row])
        group_of += [group] * len(response)
        row_of += [row] * len(response)
    group_of, row_of = torch.tensor(group_of), torch.tensor(row_of)
    total = len(ids)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    sees = causal & (group_of[:, None] == group_of[None]) & ((row_of[None] == -1) | (row_of[:, None] == row_of[None]))
    mask = torch.zeros(total, total, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)
    # the next-token entries start .. seq - 2 of each row; a padding entry points at any needed position (masked)
    needed = at[:, start:seq - 1].clone()  # (rows, seq - 1 - start)
    real = torch.arange(start, seq - 1)[None] < (torch.tensor(lengths)[:, None] - 1)
    keep = needed[real].unique()  # sorted
    where = torch.searchsorted(keep, needed).clamp(max=len(keep) - 1).masked_fill(~real, 0)
    device = input_ids.device
    return (torch.tensor(ids, device=device)[None], torch.tensor(positions, device=device)[None],
            mask.to(device)[None, None], keep.to(device), where.to(device))


def sliding_window(path: str) -> int | None:
    """The window of the model's sliding-attention layers (Mistral's, Gemma's local layers, gpt-oss's), None where
    every layer attends to the whole row (Qwen2's window is off unless its layer_types name sliding layers)."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).get_text_config()
    window, layer_types = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    return window if window and (layer_types is None or "sliding_attention" in layer_types) else None


def check_window(args) -> None:
    """Refuse --share_prompts where the policy's rows can outgrow its sliding window, which the shared mask does not
    hold: a response would read its prompt beyond the window, unlike in its own row."""
    window, longest = sliding_window(args.pretrain), args.prompt_max_len + args.generate_max_len
    if window is not None and longest > window:
        raise UserError(f"--share_prompts: {args.pretrain} attends within a sliding window of {window} tokens, which "
                        f"the shared forward's mask does not hold, and its rows reach {longest} tokens "
                        f"(--prompt_max_len + --generate_max_len); keep them within {window}, or leave out "
                        f"--share_prompts.")


def next_token_logits(model, batch: dict, start: int) -> torch.Tensor:
    """The logits that predict each row's tokens start + 1 .. seq - 1, (rows, seq - 1 - start, vocab), from one
    forward of the packed row, the LM head run on the needed positions only."""
    attention = getattr(getattr(getattr(model, "module", model), "config", None), "_attn_implementation", "sdpa")
    if attention not in ("sdpa", "eager"):
        raise UserError(f"--share_prompts keeps a shared prompt's samples apart with an attention mask, which "
                        f"{attention} does not take (the workers load it with sdpa); leave out --share_prompts.")
    dtype = next(model.parameters()).dtype
    ids, position_ids, mask, keep, where = pack(batch["input_ids"], batch["attention_mask"], batch["action_mask"],
                                                start, dtype)
    if takes_logits_to_keep(model):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                       logits_to_keep=keep).logits[0]  # (K, vocab)
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits[0, keep]
    return logits[where]


def check_once(shared: torch.Tensor, padded: torch.Tensor, mask: torch.Tensor, model_path: str,
               tolerance: float) -> None:
    """Stop the run where the first shared micro-batch's log-probs differ from the padded forward's by more than
    rounding: this model lets the packed samples read each other, or drops the mask."""
    gap = float(((shared - padded).abs() * mask).sum() / mask.sum().clamp(min=1))
    if gap > tolerance:
        raise UserError(f"--share_prompts: {model_path} computes a shared prompt's samples otherwise than separate "
                        f"rows (log-probs {gap:.2e} apart a token, where rounding allows {tolerance:g}): its "
                        f"attention does not take the mask that keeps them apart (flash-attention, a sliding window, "
                        f"recurrent layers). Leave out --share_prompts.")
