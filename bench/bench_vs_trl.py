"""ppo_ray.py's GRPO next to TRL's GRPOTrainer: same model, prompts, reward and rollout shape, in one invocation.

Both run GRPO on the synthetic addition task with its rule reward, from the same randomly initialised ~21M-parameter
Qwen2 model in float32, with no KL term (TRL's default beta is 0), one pass and one optimizer step per rollout, and
the same micro-batch. TRL generates with the model's own `generate`, in its process; ppo_ray.py with one vLLM
engine, its actor on one DeepSpeed rank (ZeRO-0, the default on one rank) unless --ppo_flags says otherwise. Each
runs in a fresh process, one after the other, so that neither competes with the other for the cores. The
throughput is completions per second of wall-clock time per step (generation, scoring, experience, update and, for
ppo_ray.py, the weight sync), the first step left out as a warm-up.

    .venv/bin/python -m pip install -r requirements-dev.txt -c constraints.txt   # TRL is a dev requirement
    .venv/bin/python bench/bench_vs_trl.py                      # both shapes, about 15 minutes on 2 CPU cores
    .venv/bin/python bench/bench_vs_trl.py --shapes small --repeats 5   # the small shape's spread, ~6 minutes
    .venv/bin/python bench/bench_vs_trl.py --shapes large --ppo_flags="--actor_num_workers 2 --zero_stage 0"
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.args import parse_args  # noqa: E402

# name -> (prompts per step, samples per prompt, new tokens at most, micro-batch, steps timed after the warm-up).
# The small shape's steps take under a second, so it times 20. Over 6, both trainers' means still held some of the
# first steps' allocator warm-up. Over 3 pairs, the ratios spanned 0.93-0.99 with 6 steps and 0.94-0.98 with 20.
SHAPES = {"small": (4, 4, 16, 16, 20), "large": (32, 8, 64, 32, 3)}
MODEL = {"architecture": "qwen2", "hidden_size": 512, "num_layers": 7, "num_heads": 8, "num_kv_heads": 2}  # 21.4M
LEARNING_RATE = 1e-6
PHASES = ("time/generate", "time/make_experience", "time/train", "time/weight_sync")  # ppo_ray.py's, in the table


@dataclass
class Args:
    shapes: list[str] = field(default_factory=lambda: list(SHAPES))
    """rollout shapes to time, from: small (4 x 4 x 16), large (32 x 8 x 64)"""
    out: str = "out/bench_vs_trl"
    """folder for the model, the task and the runs"""
    repeats: int = 1
    """runs of each shape's pair (TRL, then ppo_ray.py); the table gives the median ratio and, over 1, its range:
    this machine's speed moves 10-25% within an hour, so one pair's ratio is worth about +-0.15"""
    ppo_flags: str = ""
    """further ppo_ray.py flags, e.g. "--actor_num_workers 2" (the table says which were given)"""
    trl: str | None = None
    """(internal) run only TRL on this model folder for --shapes' first shape and print its timing as JSON"""


def trl_run(model_dir: str, prompts_file: str, shape: str, out: str) -> dict:
    """TRL's GRPOTrainer for the shape's steps; seconds per optimizer step (each one generates a rollout)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common.data import load_records
    from common.synthetic_task import reward_fn

    n_prompts, n, max_new, micro, steps = SHAPES[shape]
    records = load_records(prompts_file)[: n_prompts * (steps + 1)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in records])

    def rule_reward(prompts, completions, label, **_):
        return reward_fn([p[-1]["content"] for p in prompts], [c[-1]["content"] for c in completions], label)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.start = [], 0.0

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    config = GRPOConfig(
        output_dir=out, use_cpu=not torch.cuda.is_available(), bf16=False, max_steps=steps + 1, seed=42,
        per_device_train_batch_size=micro, gradient_accumulation_steps=n_prompts * n // micro, num_generations=n,
        max_completion_length=max_new, temperature=1.0, learning_rate=LEARNING_RATE, beta=0.0, num_iterations=1,
        logging_steps=1, save_strategy="no", report_to=[], model_init_kwargs={"dtype": torch.float32},
        shuffle_dataset=False)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=rule_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer])
    trainer.train()
    lengths = [m["completions/mean_length"] for m in trainer.state.log_history if "completions/mean_length" in m]
    return {"seconds": statistics.mean(timer.seconds[1:]), "length": statistics.mean(lengths[1:])}


def ppo_run(model_dir: str, prompts_file: str, shape: str, out: str, extra: str) -> dict:
    """ppo_ray.py's GRPO for the shape's steps; mean wall-clock seconds per step and the phases' split."""
    n_prompts, n, max_new, micro, steps = SHAPES[shape]
    cmd = [sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model_dir,
           "--reward_fn", os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn",
           "--prompt_data", prompts_file, "--apply_chat_template", "--advantage_estimator", "grpo",
           "--init_kl_coef", "0", "--rollout_batch_size", str(n_prompts), "--n_samples_per_prompt", str(n),
           "--generate_max_len", str(max_new), "--train_batch_size", str(n_prompts * n),
           "--micro_train_batch_size", str(micro), "--actor_learning_rate", str(LEARNING_RATE),
           "--max_steps", str(steps + 1), "--output_dir", out, *shlex.split(extra)]
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        log = [m for m in map(json.loads, f) if "time/step" in m][1:]
    return {"seconds": statistics.mean(m["time/step"] for m in log),
            "length": statistics.mean(m["response/length"] for m in log),
            **{k: statistics.mean(m[k] for m in log) for k in PHASES}}


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.synthetic_task import write_task
    from common.tiny_model import write_tiny_model

    prompts = os.path.join(args.out, "task", "prompts_train.jsonl")
    if args.trl:
        print(json.dumps(trl_run(args.trl, prompts, args.shapes[0], os.path.join(args.out, "trl-" + args.shapes[0]))))
        return
    model_dir = write_tiny_model(os.path.join(args.out, "qwen2-21m"), seed=0, **MODEL)
    write_task(os.path.join(args.out, "task"))
    rows = []
    for shape in args.shapes:
        for run in range(args.repeats):
            result = subprocess.run([sys.executable, os.path.abspath(__file__), "--trl", model_dir, "--shapes", shape,
                                     "--out", args.out], cwd=ROOT, check=True, capture_output=True, text=True)
            trl = json.loads(result.stdout.strip().splitlines()[-1])
            ppo = ppo_run(model_dir, prompts, shape, os.path.join(args.out, "ppo-" + shape), args.ppo_flags)
            rows.append((shape, trl, ppo))
            if args.repeats > 1:
                print(f"{shape} run {run + 1}/{args.repeats}: ratio {trl['seconds'] / ppo['seconds']:.2f}x", flush=True)

    flags = args.ppo_flags or "none"
    print(f"\nGRPO completions per second (fp32, ~21M Qwen2, rule reward; further ppo_ray.py flags: {flags}; "
          f"medians of {args.repeats} run(s))")
    print(f"{'shape':>16} {'TRL':>7} {'(len)':>6} {'ppo_ray':>8} {'(len)':>6} {'ratio':>6} {'range':>11}   "
          "ppo_ray's split, s: generate / experience / train / sync")
    for shape in args.shapes:
        n_prompts, n, max_new, *_ = SHAPES[shape]
        runs = [(trl, ppo) for s, trl, ppo in rows if s == shape]
        trl_rate = statistics.median(n_prompts * n / trl["seconds"] for trl, _ in runs)
        ppo_rate = statistics.median(n_prompts * n / ppo["seconds"] for _, ppo in runs)
        ratios = [trl["seconds"] / ppo["seconds"] for trl, ppo in runs]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(runs) > 1 else ""
        median = {k: statistics.median(ppo[k] for _, ppo in runs) for k in ("length", *PHASES)}
        split = " / ".join(f"{median[k]:.2f}" for k in PHASES)
        print(f"{f'{n_prompts} x {n} x {max_new}':>16} {trl_rate:>7.2f} "
              f"{statistics.median(trl['length'] for trl, _ in runs):>6.1f} {ppo_rate:>8.2f} {median['length']:>6.1f} "
              f"{statistics.median(ratios):>5.2f}x {spread:>11}   {split}")

if __name__ == "__main__":
    main(parse_args(Args))
