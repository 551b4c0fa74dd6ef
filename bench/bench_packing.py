"""Pairs per second of dpo.py's training forward and backward pass, with and without --packing_samples.

Synthetic pairs whose sequences (a shared prompt, then the chosen or the rejected response and EOS) are each
16 to 512 tokens long, drawn uniformly, on models built in code (common/tiny_model.py; its 2048 positions cover the
longest sequence, and a packed row restarts its positions at every sequence). Every micro-batch goes through dpo.py's
own collate, forward_logps and dpo_loss: the reference forward without gradients, the policy forward, the backward.
The optimizer step, the same work either way, is left out; so is DeepSpeed, whose engine only wraps these calls.
Also printed: the share of the padded batches that is padding, the work packing removes. With sdpa (CPU, or a GPU
without flash-attn) the packed row's block-diagonal mask is a dense (total, total) mask, so attention costs grow with
the square of the whole row's length; flash-attention's varlen kernels skip the blocks between sequences.

    python bench/bench_packing.py [--micro_batch 4] [--batches 5] [--quick]
"""

import argparse
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dpo  # noqa: E402
from common.tiny_model import SPECIAL_TOKENS, build_model, build_tokenizer  # noqa: E402

MODELS = {"tiny": {}, "wide": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}}
SHORTEST, LONGEST = 16, 512


def synthetic_pairs(tokenizer, count: int, seed: int) -> list[dict]:
    """Pairs as data.build_preference_samples returns them, with random tokens: each sequence SHORTEST..LONGEST long,
    the loss mask on the response and its EOS."""
    rng = random.Random(seed)
    token = lambda: rng.randrange(len(SPECIAL_TOKENS), len(tokenizer))
    pairs = []
    for _ in range(count):
        lengths = [rng.randint(SHORTEST, LONGEST) for _ in range(2)]
        prompt = [token() for _ in range(rng.randint(4, min(lengths) // 2))]
        pair = {"margin": 0.0}
        for side, length in zip(("chosen", "rejected"), lengths):
            response = [token() for _ in range(length - len(prompt) - 1)] + [tokenizer.eos_token_id]
            pair[side] = {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}
        pairs.append(pair)
    return pairs


def train_pass(policy, reference, batch) -> None:
    """dpo.py's work on one micro-batch, less the optimizer step."""
    with torch.no_grad():
        ref_chosen, ref_rejected = dpo.forward_logps(reference, batch)
    chosen, rejected = dpo.forward_logps(policy, batch)
    losses, _, _ = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    losses.mean().backward()
    policy.zero_grad(set_to_none=True)


def pairs_per_second(policy, reference, tokenizer, pairs, micro_batch: int) -> dict[bool, float]:
    """{packing: pairs through train_pass per second}, after one untimed micro-batch. The two layouts take turns,
    micro-batch by micro-batch, so that other work on the machine weighs on both alike."""
    seconds = {False: 0.0, True: 0.0}
    for i in range(0, len(pairs), micro_batch):
        for packing in (False, True):
            batch = dpo.collate(pairs[i: i + micro_batch], tokenizer, packing, "cpu")
            start = time.perf_counter()
            train_pass(policy, reference, batch)
            seconds[packing] += (time.perf_counter() - start) if i else 0.0
    return {packing: (len(pairs) - micro_batch) / s for packing, s in seconds.items()}


def padding_share(tokenizer, pairs, micro_batch: int) -> float:
    padded = [dpo.collate(pairs[i: i + micro_batch], tokenizer, False, "cpu")["attention_mask"]
              for i in range(0, len(pairs), micro_batch)]
    return 1 - sum(m.sum().item() for m in padded) / sum(m.numel() for m in padded)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro_batch", type=int, default=4, help="pairs per micro-batch (2x sequences per row)")
    parser.add_argument("--batches", type=int, default=5, help="timed micro-batches per configuration")
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    pairs = synthetic_pairs(tokenizer, args.micro_batch * (args.batches + 1), seed=0)
    print(f"{len(pairs)} pairs, sequences of {SHORTEST}-{LONGEST} tokens, micro-batches of {args.micro_batch} pairs: "
          f"{padding_share(tokenizer, pairs, args.micro_batch):.0%} of the padded batches is padding", flush=True)
    rows = []
    for name, shape in MODELS.items():
        if args.quick and name != "tiny":
            continue
        policy, reference = build_model(tokenizer, seed=0, **shape), build_model(tokenizer, seed=0, **shape).eval()
        rates = pairs_per_second(policy, reference, tokenizer, pairs, args.micro_batch)
        rows.append((name, rates[False], rates[True]))
        print(f"{name:5s} padded {rates[False]:6.2f} pairs/s   packed {rates[True]:6.2f} pairs/s   "
              f"({rates[True] / rates[False]:.2f}x)", flush=True)
    print("\n| model | padded pairs/s | packed pairs/s | packed / padded |\n|---|---|---|---|")
    for name, padded, packed in rows:
        print(f"| {name} | {padded:.2f} | {packed:.2f} | {packed / padded:.2f}x |")


if __name__ == "__main__":
    main()
