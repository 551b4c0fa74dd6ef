"""How often a model answers each problem right when it samples: what a sanity run picks its problems by.

A group-baseline method (GRPO, RLOO) learns from a group of samples only where their rewards differ, and DPO from
its own samples only where a better and a worse one exist: a problem the model always or never solves teaches
nothing. The field's sanity run for an RL library (prime-rl's) keeps the problems the base model solves sometimes,
say 20-80% of its samples at the sampling temperature, rewards correctness alone, and expects the training accuracy
on them to climb far above that within a short run, held-out accuracy with it.

    python -m common.solve_rate --model DIR --prompts prompts.jsonl --out band.jsonl \\
        --reward_fn launch/right_answer_reward.py:reward_fn   # the prompts solved 20-80% of the time, with their rate
"""

import argparse
import json

from common.data import load_records
from common.rewards import call_reward_fn, load_reward_fn
from common.task_eval import vllm_samples


def solve_rates(model_dir: str, rows: list[dict], reward_fn, samples: int = 8, temperature: float = 0.7,
                max_tokens: int = 32, seed: int = 0) -> list[float]:
    """Each {"prompt", "label"} row's mean reward over `samples` samples of the model (chat template applied)."""
    samples_by_row = vllm_samples(model_dir, [r["prompt"] for r in rows], samples, temperature, max_tokens, seed)
    rates = []
    for row, texts in zip(rows, samples_by_row):
        rewards = call_reward_fn(reward_fn, [row["prompt"]] * len(texts), texts, [row["label"]] * len(texts))
        rates.append(sum(rewards) / len(rewards))
    return rates


def distinct(rows: list[dict]) -> list[dict]:
    """The first row of each prompt, in order (a task file may draw its problems with replacement)."""
    seen = {}
    for row in rows:
        seen.setdefault(json.dumps(row["prompt"], sort_keys=True), row)
    return list(seen.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--prompts", required=True, help='a {"prompt", "label"} file')
    parser.add_argument("--reward_fn", required=True, help="path/to/file.py:function, as ppo_ray.py's")
    parser.add_argument("--out", required=True, help="where to write the rows in the band, each with its solve_rate")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--band", type=float, nargs=2, default=(0.2, 0.8), help="the solve rates kept, inclusive")
    parser.add_argument("--limit", type=int, default=None, help="probe only the first N distinct prompts")
    args = parser.parse_args()
    rows = distinct(load_records(args.prompts))[:args.limit]
    rates = solve_rates(args.model, rows, load_reward_fn(args.reward_fn), args.samples, args.temperature,
                        args.max_tokens)
    kept = [{**row, "solve_rate": rate} for row, rate in zip(rows, rates) if args.band[0] <= rate <= args.band[1]]
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
    print(f"{len(kept)} of {len(rows)} prompts solved {args.band[0]:.0%}-{args.band[1]:.0%} of the time "
          f"(mean solve rate of all: {sum(rates) / len(rates):.2f}) -> {args.out}")


if __name__ == "__main__":
    main()
