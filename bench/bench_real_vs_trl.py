"""make demo-real's GRPO next to TRL's GRPOTrainer on the same real model: right answers against wall-clock time.

Both train SmolLM2-135M-Instruct (common/real_model.py) on the demo's single-digit sums with its reward for right
answers alone (launch/right_answer_reward.py), from the same prompts in the same order: 8 questions x 4 samples a
step, 24 steps, temperature 0.7, at most 32 new tokens, learning rate 5e-5 (cosine down to a tenth after a 1-step
warmup, as ppo_ray.py's), no KL term (TRL's default beta is 0), one optimizer step per rollout, micro-batches of 8,
float32, no gradient checkpointing (TRL's GRPOConfig turns it on by default; ppo_ray.py leaves it off). TRL
generates with the model's own `generate` in its process; ppo_ray.py with a vLLM engine beside one DeepSpeed rank
(ZeRO-0), syncing weights after each step, once padded and once with --share_prompts as make demo-real runs it
(each question's tokens computed once for its 4 samples in the update: the same loss up to float rounding for
about half the arithmetic, as the questions are 42 tokens and the answers 8 to 25; common/prompt_sharing.py). Each
run is a fresh process, one after the other, so that none competes with another for the cores. The table gives each
run's wall-clock time, the machine's mean load average while it ran (other work on the machine slows a run, and the
runs may not have met the same), the share of sampled answers right at step 1 and over the last 6 steps, and the
greedy answers to the demo's held-out questions after; the figure, the share right against seconds.

    .venv/bin/python -m pip install -r requirements-dev.txt -c constraints.txt   # TRL is a dev requirement
    .venv/bin/python bench/bench_real_vs_trl.py            # about 15 minutes on 2 quiet CPU cores
"""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.args import parse_args  # noqa: E402
from launch.demo_real import GENERATE_MAX_LEN, GRPO_FLAGS, MAX_OPERAND, STEPS, answer, held_out_questions  # noqa: E402

PROMPTS, SAMPLES, MICRO, LEARNING_RATE, TEMPERATURE = 8, 4, 8, 5e-5, 0.7  # GRPO_FLAGS' values, for TRL's config


@dataclass
class Args:
    out: str = "out/bench_real_vs_trl"
    """folder for the task, the runs and the figure"""
    steps: int = STEPS
    """GRPO steps of each run"""
    seed: int = 0
    """both runs' seed"""
    trl: bool = False
    """(internal) run TRL alone and print its curve as JSON"""


def trl_run(model_dir: str, prompts_file: str, steps: int, seed: int, out: str) -> dict:
    """TRL's GRPOTrainer; the seconds since the start and the share of sampled answers right, by step."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import load_records
    from launch.right_answer_reward import reward_fn

    records = load_records(prompts_file)[: PROMPTS * steps]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in records])

    def right_answer(prompts, completions, label, **_):
        return reward_fn([p[-1]["content"] for p in prompts], [c[-1]["content"] for c in completions], label)

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.seconds = time.perf_counter(), []

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    config = GRPOConfig(
        output_dir=out, use_cpu=not torch.cuda.is_available(), bf16=False, max_steps=steps, seed=seed,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO,
        num_generations=SAMPLES, max_completion_length=GENERATE_MAX_LEN, temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=1, beta=0.0, gradient_checkpointing=False, num_iterations=1, logging_steps=1,
        save_strategy="no", report_to=[], model_init_kwargs={"dtype": torch.float32}, shuffle_dataset=False)
    clock = Clock()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=right_answer, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
    trainer.train()
    trainer.save_model(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    scores = [m["reward"] for m in trainer.state.log_history if "reward" in m]
    return {"seconds": clock.seconds, "scores": scores}


def ppo_run(model_dir: str, prompts_file: str, steps: int, seed: int, out: str, *extra: str) -> dict:
    """ppo_ray.py with the demo's GRPO flags (and `extra`: the demo adds --share_prompts); the seconds since the start
    (process start included) and the share right."""
    start = time.perf_counter()
    cmd = [sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model_dir, "--prompt_data", prompts_file,
           *GRPO_FLAGS, *extra, "--max_steps", str(steps), "--seed", str(seed), "--output_dir", out]
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    total = time.perf_counter() - start
    rows = [m for m in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "objective/scores" in m]
    steps_time = [m["time/step"] for m in rows]
    setup = total - sum(steps_time)  # Ray, the engine and the trainer starting, before step 1
    return {"seconds": [setup + sum(steps_time[: i + 1]) for i in range(len(rows))],
            "scores": [m["objective/scores"] for m in rows]}


class LoadAverage:
    """The machine's 1-minute load average, sampled every 10 s while the `with` block runs; `.mean` after it."""

    def __enter__(self):
        self.samples, self.done = [os.getloadavg()[0]], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.done.wait(10):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *_):
        self.done.set()
        self.thread.join()
        self.mean = statistics.mean(self.samples)


def plot(curves: dict, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, curve in curves.items():
        ax.plot(curve["seconds"], curve["scores"], marker=".", label=name)
    ax.set(title="GRPO on SmolLM2-135M-Instruct, single-digit sums", xlabel="seconds since the start",
           ylabel="share of sampled answers right", ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.real_model import real_model_dir
    from common.synthetic_task import write_task

    model_dir = real_model_dir()
    task = write_task(os.path.join(args.out, "task"), max_operand=MAX_OPERAND)
    if args.trl:
        trl = trl_run(model_dir, task["prompts_train"], args.steps, args.seed, os.path.join(args.out, "trl"))
        print(json.dumps(trl))
        return
    start = time.perf_counter()
    with LoadAverage() as trl_load:
        result = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl", "--out", args.out, "--steps",
                                 str(args.steps), "--seed", str(args.seed)], cwd=ROOT, check=True,
                                capture_output=True, text=True)
    curves = {"TRL GRPOTrainer": json.loads(result.stdout.strip().splitlines()[-1])}
    curves["TRL GRPOTrainer"].update(total=time.perf_counter() - start, load=trl_load.mean)
    runs = {"ppo_ray.py": ("ppo", []), "ppo_ray.py --share_prompts": ("ppo_shared", ["--share_prompts"])}
    for name, (folder, extra) in runs.items():
        start = time.perf_counter()
        with LoadAverage() as ppo_load:
            curves[name] = ppo_run(model_dir, task["prompts_train"], args.steps, args.seed,
                                   os.path.join(args.out, folder), *extra)
        curves[name].update(total=time.perf_counter() - start, load=ppo_load.mean)
    held_out = held_out_questions(task["prompts_eval"], 64)
    base = answer(model_dir, held_out)["accuracy"]
    for name, folder in [("TRL GRPOTrainer", "trl")] + [(name, folder) for name, (folder, _) in runs.items()]:
        curves[name]["held_out"] = answer(os.path.join(args.out, folder), held_out)["accuracy"]
    plot(curves, os.path.join(args.out, "right_answers_vs_time.png"))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(curves, f)

    window = min(6, args.steps)
    print(f"\n{args.steps} GRPO steps of {PROMPTS} questions x {SAMPLES} samples, seed {args.seed}; {len(held_out)} "
          f"held-out questions, the base model {base:.0%} right")
    print("| trainer | wall-clock, s | load average | sampled answers right: step 1 / last 6 steps | held-out right "
          "after |")
    print("|---|---|---|---|---|")
    for name, c in curves.items():
        first, last = c["scores"][0], statistics.mean(c["scores"][-window:])
        print(f"| {name} | {c['total']:.0f} | {c['load']:.1f} | {first:.0%} / {last:.0%} | {c['held_out']:.0%} |")
    print()
    for name in runs:
        print(f"{name} took {curves[name]['total'] / curves['TRL GRPOTrainer']['total']:.2f}x TRL's time")
    print(f"figure: {os.path.join(args.out, 'right_answers_vs_time.png')}")


if __name__ == "__main__":
    main(parse_args(Args))
