"""The whole alignment pipeline on a tiny model and a synthetic task, on a 2-core CPU, in under ten minutes.

Each stage runs its own script exactly as a user would type it (the commands are printed as they run):

    base model + task  python -m common.tiny_model / python -m common.synthetic_task
    SFT                deepspeed --num_gpus 2 sft.py      (2 CPU ranks, ZeRO-3) on noisy demonstrations
    reward model       deepspeed --num_gpus 2 rm.py
    PPO                python ppo_ray.py                  (Ray workers, a vLLM engine, ZeRO-3, weight sync)
    DPO, KTO           deepspeed --num_gpus 2 dpo.py / kto.py   (from the SFT model)
    rejection sampling python rejection_sampling.py       (best-of-8 with vLLM, then sft.py on the best)

The task (common/synthetic_task.py) is two-number addition whose demonstrations refuse many of the larger sums:
SFT copies the habit, and every later stage is there to remove it. The demo scores every model on 200 of the
training problems (whose sums the SFT model learned) and on 200 held-out ones (whether a model this small learns to
add pairs it never saw is luck of the seed), and writes, in the output folder, summary.md (the table printed at the
end) and ppo_curves.png (the rollouts' reward with its moving average, and the KL). Logs and checkpoints of every
stage are in the same folder. With --update_docs it also writes its table into README.md and docs/, between the
`<!-- demo-results -->` markers.
Every stage is seeded: the same machine prints the same table twice.

    python launch/demo.py --out out/demo
"""

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
DEEPSPEED_2 = [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]  # what `deepspeed --num_gpus 2` runs
COMMON = ["--apply_chat_template", "--max_len", "64", "--train_batch_size", "32", "--micro_train_batch_size", "16"]
DOCS = ["README.md", "docs/sft.md", "docs/rm.md", "docs/ppo.md", "docs/dpo.md", "docs/kto.md",
        "docs/rejection_sampling.md"]


def run(stage: str, cmd: list[str], log_dir: str, times: dict) -> None:
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
    times[stage] = time.time() - start
    print(f"[{stage}] done in {times[stage]:.0f} s (log: {os.path.relpath(log)})", flush=True)


def evaluate(model_dir: str, rm_dir: str, prompts_file: str, limit: int = 200) -> dict:
    """Greedy task accuracy, the share of answers with a number in them, and the reward model's mean (normalised)
    score of the greedy answers."""
    import torch
    import transformers

    from common.data import load_records
    from common.rewards import load_reward_model, reward_model_scores
    from common.synthetic_task import extract_answer, reward_fn
    from common.task_eval import greedy_responses

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model is noise here
    rows = load_records(prompts_file)[:limit]
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    responses = greedy_responses(model_dir, prompts)
    rm, rm_tokenizer = load_reward_model(rm_dir)
    with torch.no_grad():
        scores = reward_model_scores(rm, rm_tokenizer, prompts, responses, apply_chat_template=True)
    return {"accuracy": sum(reward_fn(prompts, responses, labels)) / len(rows),
            "answered": sum(extract_answer(r) is not None for r in responses) / len(rows),
            "reward": sum(scores) / len(scores)}


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to window - 1 values before it."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def plot_ppo(metrics_file: str, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_file)]
    rows = [r for r in rows if "objective/scores" in r]
    steps, scores = [r["step"] for r in rows], [r["objective/scores"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, scores, marker=".", alpha=0.4, label="per step")
    ax1.plot(steps, moving_average(scores, 4), linewidth=2, label="moving average (4 steps)")
    ax1.set(title="PPO: mean reward of the rollouts", xlabel="PPO step", ylabel="objective/scores")
    ax1.legend()
    ax2.plot(steps, [r["objective/kl"] for r in rows], marker=".", color="tab:red")
    ax2.set(title="KL(policy || SFT reference)", xlabel="PPO step", ylabel="objective/kl")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def last_metric(out_dir: str, key: str) -> float | None:
    """The last logged value of `key` in a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return next((r[key] for r in reversed(rows) if key in r), None)


def machine() -> str:
    """The machine in a few words: CPU model and core count (the numbers move with the CPU's float kernels)."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = re.findall(r"model name\s*:\s*(.+)", open("/proc/cpuinfo").read())
        cpu = names[0].strip() if names else cpu
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{len(os.sched_getaffinity(0))}-core {cpu}, {gpu}"


def update_docs(block: str) -> list[str]:
    """Replace what stands between `<!-- demo-results -->` and `<!-- /demo-results -->` in README.md and docs/."""
    changed = []
    for name in DOCS:
        path = os.path.join(ROOT, name)
        text = open(path).read()
        new = re.sub(r"<!-- demo-results -->.*?<!-- /demo-results -->",
                     lambda _: f"<!-- demo-results -->\n{block}\n<!-- /demo-results -->", text, flags=re.S)
        if new != text:
            open(path, "w").write(new)
            changed.append(name)
    return changed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", help="output folder (emptied first)")
    parser.add_argument("--ppo_steps", type=int, default=12, help="PPO steps")
    parser.add_argument("--update_docs", action="store_true", help="write the results into README.md and docs/")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    logs = os.path.join(out, "logs")
    os.makedirs(logs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = {name: os.path.join(out, name) for name in ("base", "task", "sft", "rm", "ppo", "dpo", "kto", "rs")}
    task = lambda name: os.path.join(d["task"], name + ".jsonl")
    rule = "common/synthetic_task.py:reward_fn"
    started, times, load = time.time(), {}, os.getloadavg()[0]  # other jobs on the cores slow every stage down

    run("setup", [PY, "-m", "common.tiny_model", "--out", d["base"]], logs, times)
    run("task", [PY, "-m", "common.synthetic_task", "--out", d["task"]], logs, times)
    run("sft", [*DEEPSPEED_2, "sft.py", "--pretrain", d["base"], "--dataset", task("sft_train"), "--eval_dataset",
                task("sft_eval"), *COMMON, "--max_steps", "600", "--learning_rate", "2e-3", "--warmup_ratio", "0.05",
                "--eval_steps", "200", "--output_dir", d["sft"]], logs, times)
    run("rm", [*DEEPSPEED_2, "rm.py", "--pretrain", d["sft"], "--dataset", task("pref_train"), "--eval_dataset",
               task("pref_eval"), *COMMON, "--max_epochs", "2", "--learning_rate", "1e-4", "--output_dir", d["rm"]],
        logs, times)
    run("ppo", [PY, "ppo_ray.py", "--pretrain", d["sft"], "--reward_pretrain", d["rm"], "--reward_fn", rule,
                "--critic_pretrain", d["rm"], "--prompt_data", task("prompts_train"), "--eval_prompt_data",
                task("prompts_eval"), "--apply_chat_template", "--prompt_max_len", "64", "--generate_max_len", "8",
                "--max_steps", str(args.ppo_steps), "--rollout_batch_size", "64", "--n_samples_per_prompt", "8",
                "--train_batch_size", "128", "--micro_train_batch_size", "64", "--actor_num_workers", "2",
                "--actor_learning_rate", "3e-4", "--critic_learning_rate", "3e-4", "--init_kl_coef", "0.001",
                "--eval_steps", "4", "--output_dir", d["ppo"]], logs, times)
    run("dpo", [*DEEPSPEED_2, "dpo.py", "--pretrain", d["sft"], "--dataset", task("pref_train"), "--eval_dataset",
                task("pref_eval"), *COMMON, "--max_steps", "60", "--learning_rate", "1e-4", "--beta", "0.1",
                "--nll_loss_coef", "1", "--output_dir", d["dpo"]], logs, times)
    run("kto", [*DEEPSPEED_2, "kto.py", "--pretrain", d["sft"], "--dataset", task("kto_train"), "--eval_dataset",
                task("kto_eval"), *COMMON,
                "--max_steps", "60", "--learning_rate", "2e-4", "--beta", "0.1", "--desirable_weight", "1.33",
                "--output_dir", d["kto"]],
        logs, times)
    run("rs", [PY, "rejection_sampling.py", "--pretrain", d["sft"], "--dataset", task("prompts_train"),
               "--apply_chat_template", "--max_samples", "1000", "--n_samples_per_prompt", "8", "--generate_max_len",
               "8", "--max_model_len", "128", "--enforce_eager", "--reward_fn", rule, "--min_reward", "1.0",
               "--iterations", "1", "--train_args", "--max_steps 60 --micro_train_batch_size 16 --learning_rate 2e-4 "
               "--max_len 64", "--output_dir", d["rs"]], logs, times)

    print("\n[eval] scoring every model on training and held-out problems", flush=True)
    models = [("base", d["base"]), ("SFT", d["sft"]), ("PPO (from SFT)", d["ppo"]), ("DPO (from SFT)", d["dpo"]),
              ("KTO (from SFT)", d["kto"]), ("best-of-8 + SFT (from SFT)", os.path.join(d["rs"], "iter_0", "model"))]
    rows = [(name, evaluate(model, d["rm"], task("prompts_train")), evaluate(model, d["rm"], task("prompts_eval")))
            for name, model in models]
    plot_ppo(os.path.join(d["ppo"], "metrics.jsonl"), os.path.join(out, "ppo_curves.png"))
    ppo_scores = [json.loads(line)["objective/scores"] for line in open(os.path.join(d["ppo"], "metrics.jsonl"))
                  if "objective/scores" in line]
    window = max(1, min(4, len(ppo_scores) // 2))  # first and last steps, apart even in a short run
    from common.data import load_records

    distinct = lambda name: len({json.dumps(r["prompt"]) for r in load_records(task(name))[:200]})
    first, last = statistics.mean(ppo_scores[:window]), statistics.mean(ppo_scores[-window:])

    table = ["| model | accuracy: training problems | answered with a number | mean reward-model score | "
             "accuracy: held-out problems |", "|---|---|---|---|---|"]
    table += [f"| {name} | {m['accuracy']:.1%} | {m['answered']:.1%} | {m['reward']:+.3f} | {h['accuracy']:.1%} |"
              for name, m, h in rows]
    results = "\n".join([
        *table, "",
        f"Greedy answers to 200 training problems ({distinct('prompts_train')} distinct) and, in the last column, to "
        f"200 held-out problems ({distinct('prompts_eval')} distinct: the task draws them with replacement), whose "
        f"operand pairs no stage trained on. Reward model: {last_metric(d['rm'], 'eval/accuracy'):.1%} "
        f"of held-out pairs ranked right (chance 50%). PPO rollouts' mean reward: {first:.3f} over the first {window} "
        f"steps, {last:.3f} over the last {window}. Implicit reward: "
        f"{last_metric(d['dpo'], 'eval/rewards/accuracies'):.1%} of held-out pairs ranked right (DPO), "
        f"{last_metric(d['kto'], 'eval/rewards/accuracies'):.1%} of held-out responses on the right side of 0 (KTO).",
    ])
    timing = (f"`make demo` on a {machine()}, {time.strftime('%Y-%m-%d')}: {time.time() - started:.0f} s in all "
              f"(" + ", ".join(f"{k} {v:.0f}" for k, v in times.items() if v >= 1) + f" s; load average {load:.1f} "
              "when it started).")
    rel = os.path.relpath  # paths as the user would type them from where they ran the demo
    summary = "\n".join([
        "# Demo results", "",
        "Tiny Llama (0.87M parameters) on the synthetic addition task, whose SFT demonstrations refuse many of the "
        "larger sums.", "", results, "", timing, "",
        f"PPO curves: {rel(os.path.join(out, 'ppo_curves.png'))}. Logs: {rel(logs)}. Models and metrics: one folder "
        f"per stage in {rel(out)}.",
    ])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary + "\n")
    print("\n" + summary)
    if args.update_docs:
        changed = update_docs(results + "\n\n" + timing)
        print(f"\nwrote the results into {', '.join(changed) or 'no file (no markers found)'}")


if __name__ == "__main__":
    main()
