"""ppo_ray.py on a long-tail length distribution: synchronous, --async_rollouts, and --partial_rollouts on top of it.

With --async_rollouts a step still waits for its slowest sample; --partial_rollouts cuts the generation at the step
boundary and lets the long samples go on under the next policy (common/partial_rollouts.py). This bench gives the
three one after the other the same rollouts of the reasoning shape (few prompts, several samples each, responses
that may run far longer than the prompt) from a policy whose response lengths have a long tail: most responses end
after a few tokens, about --long_share of them run to --generate_max_len.

The policy is the tiny model made a Markov chain over its last token (its attention and MLP outputs zeroed, one
embedding axis per state): after the prompt it enters a short state (digits, an EOS with probability 0.3 after each)
or, with probability --long_share, a long state (letters, no EOS). GRPO trains it at a small learning rate on a
reward that does not care for the length (the share of even digits and of every other letter), so the tail stays.
Printed: seconds per step after the first, response tokens trained per second, the share of responses cut at the
limit, and for the partial run the staleness histogram of the trained tokens.

    .venv/bin/python bench/bench_partial_rollouts.py                 # 12 steps each (about 5 minutes on 2 cores)
    .venv/bin/python bench/bench_partial_rollouts.py --steps 8 --max_staleness 4     # docs/ppo.md's rows
"""

import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.args import parse_args  # noqa: E402

# A reward blind to the length: each response's share of characters from this set (half of each state's tokens).
REWARD = '''
def reward_fn(prompts, responses, labels):
    return [sum(c in "02468acegi" for c in r) / max(1, len(r)) for r in responses]
'''


@dataclass
class Args:
    out: str = "out/bench_partial_rollouts"
    """folder for the task, the policy and the three runs"""
    steps: int = 12
    """PPO steps per run"""
    rollout_batch_size: int = 8
    """prompts per step"""
    n_samples_per_prompt: int = 4
    """responses per prompt"""
    generate_max_len: int = 512
    """the length limit the long responses run to"""
    long_share: float = 0.1
    """the share of responses that run to the limit"""
    max_staleness: int = 2
    """the partial run's --max_staleness"""
    seed: int = 0
    """seed of the task, the model and the runs"""


def long_tail_model(args: Args, path: str) -> str:
    """The tiny model as a Markov chain with a long tail of lengths (see the docstring), saved to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tiny_model import write_tiny_model

    base = write_tiny_model(path + "_base", seed=args.seed)
    tokenizer, model = AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True,
                                           tokenize=False)
    start = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]  # every prompt's last token
    short, long = (tokenizer.convert_tokens_to_ids(list(chars)) for chars in ("0123456789", "abcdefghij"))
    scale = model.config.hidden_size ** 0.5  # RMSNorm turns a one-hot embedding into sqrt(hidden) on its axis
    with torch.no_grad():
        for layer in model.model.layers:  # each position's output is its own token's embedding alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[start, 0], embed[short, 1], embed[long, 2] = 1.0, 1.0, 1.0
        model.model.norm.weight.fill_(1.0)
        head.zero_()
        head[:, :3] = -30 / scale  # every other token, in every state: never
        for state, tokens, logprob in ((0, short, math.log((1 - args.long_share) / 10)),
                                       (0, long, math.log(args.long_share / 10)),
                                       (1, short, math.log(0.7 / 10)), (1, [tokenizer.eos_token_id], math.log(0.3)),
                                       (2, long, math.log(1 / 10))):
            head[tokens, state] = logprob / scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_ppo(args: Args, model: str, task: dict, reward: str, out: str, *extra: str) -> list[dict]:
    """One GRPO run; returns its per-step metrics."""
    cmd = [sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model, "--prompt_data",
           task["prompts_train"], "--apply_chat_template", "--output_dir", out, "--generate_max_len",
           str(args.generate_max_len), "--prompt_max_len", "64", "--reward_fn", f"{reward}:reward_fn",
           "--advantage_estimator", "grpo", "--n_samples_per_prompt", str(args.n_samples_per_prompt),
           "--rollout_batch_size", str(args.rollout_batch_size),
           "--train_batch_size", str(args.rollout_batch_size * args.n_samples_per_prompt),
           "--micro_train_batch_size", str(args.n_samples_per_prompt), "--actor_learning_rate", "1e-5",
           "--max_steps", str(args.steps), "--seed", str(args.seed), *extra]
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "time/train" in m]


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.synthetic_task import write_task

    os.makedirs(args.out, exist_ok=True)
    task = write_task(os.path.join(args.out, "task"), seed=args.seed)
    model = long_tail_model(args, os.path.join(args.out, "long_tail"))
    reward = os.path.join(args.out, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    partial = ("--async_rollouts", "--partial_rollouts", "--max_staleness", str(args.max_staleness))
    runs = {name: run_ppo(args, model, task, reward, os.path.join(args.out, name), *extra)
            for name, extra in (("sync", ()), ("async", ("--async_rollouts",)), ("partial", partial))}

    size = args.rollout_batch_size * args.n_samples_per_prompt
    print(f"\nGRPO, {args.rollout_batch_size} prompts x {args.n_samples_per_prompt} samples, up to "
          f"{args.generate_max_len} tokens, {args.long_share:.0%} of them at the limit by design; {args.steps} steps, "
          f"means after the first")
    print(f"{'run':>8} {'s/step':>7} {'tokens/s':>9} {'generate':>9} {'train':>7} {'at limit':>9} {'length':>7}")
    for name, log in runs.items():
        steady = log[1:]

        def mean(key):
            return statistics.mean(m.get(key, 0) for m in steady)

        tokens_per_s = sum(m["response/length"] * size for m in steady) / sum(m["time/step"] for m in steady)
        print(f"{name:>8} {mean('time/step'):>7.2f} {tokens_per_s:>9.0f} {mean('time/generate'):>9.2f} "
              f"{mean('time/train'):>7.2f} {mean('response/truncated'):>9.3f} {mean('response/length'):>7.1f}")
    steady = runs["partial"][1:]
    histogram = " / ".join(f"{statistics.mean(m[f'partial/staleness_{k}'] for m in steady):.3f}"
                           for k in range(args.max_staleness + 1))
    print(f"\npartial: trained tokens of staleness 0..{args.max_staleness}: {histogram} (mean "
          f"{statistics.mean(m['partial/staleness_mean'] for m in steady):.3f}); samples dropped as too stale "
          f"{sum(m['partial/dropped'] for m in runs['partial']):.0f} in all; cut and continued "
          f"{statistics.mean(m['partial/continued'] for m in steady):.3f} of the samples; prompts carried over "
          f"{statistics.mean(m['partial/in_flight'] for m in steady):.1f} per step")


if __name__ == "__main__":
    main(parse_args(Args))
