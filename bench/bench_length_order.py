"""Seconds of ppo_ray.py's actor update with each optimizer step's rows cut into micro-batches shortest first,
against the cut before that change (the shuffled rows in turn).

A rollout of 8 prompts x 8 samples with random tokens: prompts of 16-64 tokens, responses of 16-512 drawn
uniformly (the spread of a reasoning task's answers), one optimizer step over the 64 rows in micro-batches of 4.
The update is ActorWorker.fit itself on a model built in code (common/tiny_model.py), with a plain torch AdamW
standing in for the DeepSpeed engine, which only wraps the same forward, backward and step. Since each micro-batch's
loss is its share of the whole step's aggregate, both cuts give the same gradient; the sorted one pads less.
Printed: the share of each cut's micro-batches that is padding, and the update's seconds (median of --repeats,
the two cuts taking turns so that other work on the machine weighs on both alike).

    python bench/bench_length_order.py [--repeats 3] [--quick]
"""

import argparse
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ppo_ray  # noqa: E402
from common.tiny_model import SPECIAL_TOKENS, build_model, build_tokenizer  # noqa: E402

MODELS = {"tiny": {}, "wide": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}}
PROMPTS, SAMPLES, MICRO = 8, 8, 4


class PlainEngine:
    """What ActorWorker.fit calls on its DeepSpeed engine, around a plain model and torch's AdamW."""

    def __init__(self, model, accumulation: int):
        self.module, self.accumulation, self.micro_steps = model, accumulation, 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def train(self):
        self.module.train()

    def gradient_accumulation_steps(self):
        return self.accumulation

    def backward(self, loss):
        (loss / self.accumulation).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self):
        return [1e-6]


def rollout(tokenizer, seed: int) -> dict:
    """An experience batch as ppo_ray.build_batch lays it out, on policy (fit makes the old log-probs)."""
    rng = random.Random(seed)
    token = lambda: rng.randrange(len(SPECIAL_TOKENS), len(tokenizer))
    prompts = [[token() for _ in range(rng.randint(16, 64))] for _ in range(PROMPTS)]
    samples = [[{"token_ids": [token() for _ in range(rng.randint(16, 512))], "logprobs": None}
                for _ in range(SAMPLES)] for _ in prompts]
    batch = ppo_ray.build_batch(prompts, samples, tokenizer.pad_token_id)
    advantages = torch.randn(len(batch["input_ids"]), 1, generator=torch.Generator().manual_seed(seed))
    return {**batch, "advantages": advantages * batch["action_mask"]}


def padding_share(batch: dict, sort: bool) -> float:
    cut = ppo_ray.split(batch, MICRO, 0, len(batch["input_ids"]) if sort else None)
    return 1 - sum(mb["attention_mask"].sum().item() for mb in cut) / sum(mb["attention_mask"].numel() for mb in cut)


def update_seconds(model, tokenizer, batch: dict, sort: bool) -> float:
    """One ActorWorker.fit over the batch; sort=False puts back the cut before this change."""
    actor = object.__new__(ppo_ray.ActorWorker)  # the worker as setup() leaves it, without Ray or DeepSpeed
    actor.args = ppo_ray.Args(micro_train_batch_size=MICRO, max_epochs=1, advantage_estimator="grpo",
                              init_kl_coef=0.0, generate_max_len=512)
    actor.engine, actor.tokenizer, actor.rank, actor.world_size, actor.ptx = (
        PlainEngine(model, len(batch["input_ids"]) // MICRO), tokenizer, 0, 1, None)
    real_split = ppo_ray.split
    if not sort:
        ppo_ray.split = lambda b, size, seed=None, sort_rows=None: real_split(b, size, seed)
    try:
        start = time.perf_counter()
        actor.fit({k: v.clone() for k, v in batch.items()}, 0.0, 0)
        return time.perf_counter() - start
    finally:
        ppo_ray.split = real_split


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates of each cut, after one untimed pair")
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    batch = rollout(tokenizer, seed=0)
    shares = {sort: padding_share(batch, sort) for sort in (False, True)}
    print(f"{PROMPTS} x {SAMPLES} rows of 32-576 tokens, micro-batches of {MICRO}: padding {shares[False]:.0%} of the "
          f"micro-batches cut in turn, {shares[True]:.0%} cut shortest first", flush=True)
    rows = []
    for name, shape in MODELS.items():
        if args.quick and name != "tiny":
            continue
        model = build_model(tokenizer, seed=0, **shape)
        seconds = {False: [], True: []}
        for repeat in range(args.repeats + 1):
            for sort in (False, True):
                elapsed = update_seconds(model, tokenizer, batch, sort)
                if repeat:
                    seconds[sort].append(elapsed)
        before, after = statistics.median(seconds[False]), statistics.median(seconds[True])
        rows.append((name, before, after))
        print(f"{name:5s} in turn {before:6.2f} s  shortest first {after:6.2f} s  ({before / after:.2f}x)", flush=True)
    print("\n| model | padding in turn / shortest first | update s, in turn | shortest first | speed-up |\n"
          "|---|---|---|---|---|")
    for name, before, after in rows:
        print(f"| {name} | {shares[False]:.0%} / {shares[True]:.0%} | {before:.2f} | {after:.2f} | "
              f"{before / after:.2f}x |")


if __name__ == "__main__":
    main()
