"""ppo_ray.py with and without --async_rollouts: steps per second and the reward curve of each, at equal rollouts.

Both runs are GRPO on the synthetic task from the same SFT model with the same prompts, seed and rollout shape (the
learning test's recipe: 64 prompts x 8 samples per step, four optimizer steps each). The synchronous run generates,
then trains; the asynchronous one generates step k+1 while step k trains, from the policy one update old. What is
printed: seconds per step after the first (a warm-up), the time the driver waits for each phase, the reward of each
step's rollouts, and the held-out accuracy of both final policies.

    .venv/bin/python bench/bench_async.py                     # trains the SFT model first (about 2 minutes)
    .venv/bin/python bench/bench_async.py --steps 4          # a quicker look
"""

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.args import parse_args  # noqa: E402

PHASES = ("time/generate", "time/make_experience", "time/train", "time/weight_sync")


@dataclass
class Args:
    out: str = "out/bench_async"
    """folder for the task, the SFT model and the two runs"""
    sft_model: str | None = None
    """the policy to start from (default: the tiny model after the test suite's SFT on this --seed's task, trained
    here)"""
    steps: int = 12
    """PPO steps per run"""
    rollout_batch_size: int = 64
    """prompts per step"""
    n_samples_per_prompt: int = 8
    """responses per prompt"""
    seed: int = 0
    """seed of the task, the SFT and both PPO runs"""


def run(cmd: list[str], log_path: str) -> None:
    with open(log_path, "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)


def sft_model(args: Args, task: dict) -> str:
    """The test suite's SFT model (tests/conftest.py: sft_model), trained once per --seed into --out."""
    out = os.path.join(args.out, f"sft_seed{args.seed}")  # another seed's task needs its own SFT
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from common.tiny_model import write_tiny_model

    base = write_tiny_model(os.path.join(args.out, "tiny"), seed=args.seed)
    run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", os.path.join(ROOT, "sft.py"),
         "--pretrain", base, "--dataset", task["sft_train"], "--apply_chat_template", "--max_len", "64",
         "--max_steps", "600", "--train_batch_size", "32", "--micro_train_batch_size", "16", "--learning_rate",
         "2e-3", "--warmup_ratio", "0.05", "--seed", str(args.seed), "--output_dir", out], out + ".log")
    return out


def run_ppo(args: Args, model: str, task: dict, out: str, *extra: str) -> list[dict]:
    """One GRPO run; returns its per-step metrics."""
    run([sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model, "--prompt_data", task["prompts_train"],
         "--apply_chat_template", "--output_dir", out, "--generate_max_len", "8", "--prompt_max_len", "64",
         "--reward_fn", os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn",
         "--advantage_estimator", "grpo", "--n_samples_per_prompt", str(args.n_samples_per_prompt),
         "--rollout_batch_size", str(args.rollout_batch_size), "--train_batch_size", "128",
         "--micro_train_batch_size", "64", "--actor_learning_rate", "3e-4", "--init_kl_coef", "0.001",
         "--max_steps", str(args.steps), "--seed", str(args.seed), *extra], out + ".log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "time/train" in m]


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.synthetic_task import write_task
    from common.task_eval import task_scores

    os.makedirs(args.out, exist_ok=True)
    task = write_task(os.path.join(args.out, "task"), seed=args.seed)
    model = args.sft_model or sft_model(args, task)
    runs = {}
    for name, extra in (("sync", ()), ("async", ("--async_rollouts",))):
        out = os.path.join(args.out, name)
        log = run_ppo(args, model, task, out, *extra)
        runs[name] = {"log": log, "eval": task_scores(out, task["prompts_eval"])}
    before = task_scores(model, task["prompts_eval"])

    print(f"\nGRPO, {args.rollout_batch_size} prompts x {args.n_samples_per_prompt} samples per step, {args.steps} "
          f"steps; seconds per step after the first (the driver's wait for each phase)")
    print(f"{'run':>6} {'step':>6} {'steps/s':>8} " + " ".join(f"{p.split('/')[1]:>15}" for p in PHASES))
    for name, r in runs.items():
        steady = r["log"][1:]
        per_step = statistics.mean(sum(m.get(p, 0) for p in PHASES) for m in steady)
        print(f"{name:>6} {per_step:>6.2f} {1 / per_step:>8.3f} "
              + " ".join(f"{statistics.mean(m.get(p, 0) for m in steady):>15.2f}" for p in PHASES))
    print("\nreward of each step's rollouts (0/1 rule), then held-out answered / accuracy of the final policy "
          f"(SFT: {before['answered']:.3f} / {before['accuracy']:.3f})")
    for name, r in runs.items():
        print(f"{name:>6} " + " ".join(f"{m['objective/scores']:.2f}" for m in r["log"])
              + f"   | {r['eval']['answered']:.3f} / {r['eval']['accuracy']:.3f}")


if __name__ == "__main__":
    main(parse_args(Args))
