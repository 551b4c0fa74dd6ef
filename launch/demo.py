"""The whole alignment pipeline on a tiny model and a synthetic task, on a laptop-class CPU, in about ten minutes.

Each stage runs its own script exactly as a user would type it (the commands are printed as they run):

    base model + task  python -m common.tiny_model / python -m common.synthetic_task
    SFT                deepspeed --num_gpus 2 sft.py      (2 CPU ranks, ZeRO-3)
    reward model       deepspeed --num_gpus 2 rm.py
    PPO                python ppo_ray.py                  (Ray workers, a vLLM engine, ZeRO-3, weight sync)
    DPO                deepspeed --num_gpus 2 dpo.py      (from the SFT model, on the same preference pairs)

then scores every model on held-out problems and writes, in the output folder, summary.md (the table printed at the
end) and ppo_curves.png (reward and KL over the PPO steps). Logs and checkpoints of every stage are in the same
folder.

    python launch/demo.py --out out/demo
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
DEEPSPEED_2 = [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]  # what `deepspeed --num_gpus 2` runs


def run(stage: str, cmd: list[str], log_dir: str) -> float:
    """Run one stage, its output going to <log_dir>/<stage>.log; stop the demo if it fails."""
    shown = " ".join(shlex.quote("python" if c == PY else c.replace(ROOT + os.sep, "")) for c in cmd)
    shown = shown.replace("python -m deepspeed.launcher.runner", "deepspeed")
    print(f"\n[{stage}] {shown}", flush=True)
    start = time.time()
    log = os.path.join(log_dir, f"{stage}.log")
    with open(log, "w") as f:
        result = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        sys.exit(f"{tail}\nthe {stage} stage failed (exit {result.returncode}); its whole log is {log}")
    print(f"[{stage}] done in {time.time() - start:.0f} s (log: {os.path.relpath(log)})", flush=True)
    return time.time() - start


def evaluate(model_dir: str, rm_dir: str, prompts_file: str) -> dict:
    """Greedy task accuracy and the reward model's mean (normalised) score of the greedy answers."""
    import torch
    import transformers

    from common.data import load_records
    from common.rewards import load_reward_model, reward_model_scores
    from common.synthetic_task import reward_fn
    from common.task_eval import greedy_responses

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model is noise here
    rows = load_records(prompts_file)
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    responses = greedy_responses(model_dir, prompts)
    accuracy = sum(reward_fn(prompts, responses, labels)) / len(rows)
    rm, rm_tokenizer = load_reward_model(rm_dir)
    with torch.no_grad():
        scores = reward_model_scores(rm, rm_tokenizer, prompts, responses, apply_chat_template=True)
    return {"accuracy": accuracy, "reward": sum(scores) / len(scores)}


def plot_ppo(metrics_file: str, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_file)]
    rows = [r for r in rows if "objective/scores" in r]
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, [r["objective/scores"] for r in rows], marker=".")
    ax1.set(title="PPO: mean reward of the rollouts", xlabel="PPO step", ylabel="objective/scores")
    ax2.plot(steps, [r["objective/kl"] for r in rows], marker=".", color="tab:red")
    ax2.set(title="KL(policy || SFT reference)", xlabel="PPO step", ylabel="objective/kl")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", help="output folder (emptied first)")
    parser.add_argument("--sft_steps", type=int, default=600, help="SFT optimizer steps")
    parser.add_argument("--ppo_steps", type=int, default=20, help="PPO steps")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    logs = os.path.join(out, "logs")
    os.makedirs(logs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = {name: os.path.join(out, name) for name in ("base", "task", "sft", "rm", "ppo", "dpo")}
    task = lambda name: os.path.join(d["task"], name + ".jsonl")
    started = time.time()
    times = {}

    times["setup"] = run("setup", [PY, "-m", "common.tiny_model", "--out", d["base"]], logs)
    run("task", [PY, "-m", "common.synthetic_task", "--out", d["task"]], logs)
    times["sft"] = run("sft", [*DEEPSPEED_2, "sft.py", "--pretrain", d["base"], "--dataset", task("sft_train"),
                               "--eval_dataset", task("sft_eval"), "--apply_chat_template", "--max_len", "64",
                               "--max_steps", str(args.sft_steps), "--train_batch_size", "32",
                               "--micro_train_batch_size", "16", "--learning_rate", "2e-3", "--warmup_ratio", "0.05",
                               "--eval_steps", "200", "--output_dir", d["sft"]], logs)
    times["rm"] = run("rm", [*DEEPSPEED_2, "rm.py", "--pretrain", d["sft"], "--dataset", task("pref_train"),
                             "--eval_dataset", task("pref_eval"), "--apply_chat_template", "--max_len", "64",
                             "--max_epochs", "3", "--train_batch_size", "32", "--micro_train_batch_size", "16",
                             "--learning_rate", "1e-4", "--output_dir", d["rm"]], logs)
    times["ppo"] = run("ppo", [PY, "ppo_ray.py", "--pretrain", d["sft"], "--reward_pretrain", d["rm"],
                               "--reward_fn", "common/synthetic_task.py:reward_fn", "--critic_pretrain", d["rm"],
                               "--prompt_data", task("prompts_train"), "--eval_prompt_data", task("prompts_eval"),
                               "--apply_chat_template", "--prompt_max_len", "64", "--generate_max_len", "8",
                               "--max_steps", str(args.ppo_steps), "--rollout_batch_size", "64",
                               "--n_samples_per_prompt", "8", "--train_batch_size", "256",
                               "--micro_train_batch_size", "64", "--actor_num_workers", "2",
                               "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4",
                               "--init_kl_coef", "0.001", "--eval_steps", "5", "--output_dir", d["ppo"]], logs)
    times["dpo"] = run("dpo", [*DEEPSPEED_2, "dpo.py", "--pretrain", d["sft"], "--dataset", task("pref_train"),
                               "--eval_dataset", task("pref_eval"), "--apply_chat_template", "--max_len", "64",
                               "--max_epochs", "1", "--train_batch_size", "32", "--micro_train_batch_size", "16",
                               "--learning_rate", "1e-4", "--beta", "0.1", "--nll_loss_coef", "1",
                               "--output_dir", d["dpo"]], logs)

    print("\n[eval] scoring every model on held-out problems", flush=True)
    rows = []
    for stage, model in [("base", d["base"]), ("SFT", d["sft"]), ("PPO", d["ppo"]), ("DPO", d["dpo"])]:
        rows.append((stage, evaluate(model, d["rm"], task("prompts_eval"))))
    plot_ppo(os.path.join(d["ppo"], "metrics.jsonl"), os.path.join(out, "ppo_curves.png"))
    rm_log = [json.loads(line) for line in open(os.path.join(d["rm"], "metrics.jsonl"))]
    rm_accuracy = next((r[k] for r in reversed(rm_log) for k in r if k.startswith("eval/") and "acc" in k), None)

    table = ["| model | task accuracy (greedy, held-out) | mean reward-model score |", "|---|---|---|"]
    table += [f"| {stage} | {m['accuracy']:.1%} | {m['reward']:+.3f} |" for stage, m in rows]
    rel = os.path.relpath  # paths as the user would type them from where they ran the demo
    summary = "\n".join([
        "# Demo results", "",
        f"Tiny Llama ({rel(d['base'])}) on the synthetic addition task; {len(open(task('prompts_eval')).readlines())} "
        "held-out problems, answered greedily.", "", *table, "",
        f"Reward model preference accuracy on held-out pairs: {rm_accuracy:.1%} (chance: 50%)"
        if rm_accuracy is not None else "",
        "Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items())
        + f"; total {time.time() - started:.0f}.", "",
        f"PPO curves: {rel(os.path.join(out, 'ppo_curves.png'))}. Logs: {rel(logs)}. Models and metrics: one folder "
        f"per stage in {rel(out)}.",
    ])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary + "\n")
    print("\n" + summary)


if __name__ == "__main__":
    main()
