"""A visual task that SFT teaches partly and GRPO improves, on a tiny vision-language model, on a 2-core CPU.

Each stage runs its own script as a user would type it (the commands are printed as they run):

    base model + task  python -m common.tiny_vlm / python -m common.synthetic_image_task --refusal_rate 0.7
    SFT                python sft.py       (the vision tower frozen, the default)
    GRPO               python ppo_ray.py   (a vLLM engine sampling with the images, the rule reward)

The task (common/synthetic_image_task.py) asks "How many red squares?" of 3 x 3 grids of shapes. Its demonstrations
refuse most scenes of 2 or 3 red squares ("I am not sure."), as a hurried annotator leaves the harder ones: SFT
learns to read the scenes and copies the habit, so the SFT model answers about half the held-out scenes right. GRPO,
rewarded for the right count alone, removes the habit: the counts it had seen for such scenes, sampled now and then,
are rewarded, the refusal never is. Every model is scored by greedy decoding on the held-out scenes (accuracy, and
the share answered with a number at all); summary.md and summary.json in the output folder hold the table.

    python launch/demo_vlm.py --out out/demo_vlm
"""

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launch.demo import PY, machine, run  # noqa: E402  (the stage runner and machine line of the text demo)

NUM_TRAIN, NUM_EVAL = 512, 96
REFUSAL_RATE = 0.7


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo_vlm", help="output folder (emptied first)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the scenes and every script")
    parser.add_argument("--sft_steps", type=int, default=300, help="SFT steps of 16 scenes")
    parser.add_argument("--grpo_steps", type=int, default=40, help="GRPO steps of 16 scenes x 8 responses")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    logs = os.path.join(out, "logs")
    os.makedirs(logs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = {name: os.path.join(out, name) for name in ("base", "task", "sft", "grpo")}
    task = lambda name: os.path.join(d["task"], name + ".jsonl")
    seed = str(args.seed)
    started, times, load = time.time(), {}, os.getloadavg()[0]  # other jobs on the cores slow every stage down

    run("base", [PY, "-m", "common.tiny_vlm", "--out", d["base"], "--seed", seed], logs, times)
    run("task", [PY, "-m", "common.synthetic_image_task", "--out", d["task"], "--seed", seed, "--num_train",
                 str(NUM_TRAIN), "--num_eval", str(NUM_EVAL), "--refusal_rate", str(REFUSAL_RATE)], logs, times)
    run("sft", [PY, "sft.py", "--pretrain", d["base"], "--dataset", task("sft_train"), "--apply_chat_template",
                "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "16", "--learning_rate",
                "3e-3", "--max_steps", str(args.sft_steps), "--seed", seed, "--output_dir", d["sft"]], logs, times)
    run("grpo", [PY, "ppo_ray.py", "--pretrain", d["sft"], "--prompt_data", task("prompts_train"),
                 "--apply_chat_template", "--reward_fn", "common/synthetic_task.py:reward_fn",
                 "--advantage_estimator", "grpo", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
                 "--train_batch_size", "128", "--micro_train_batch_size", "16", "--generate_max_len", "8",
                 "--prompt_max_len", "64", "--actor_learning_rate", "3e-4", "--init_kl_coef", "0.001",
                 "--max_steps", str(args.grpo_steps), "--seed", seed, "--eval_prompt_data", task("prompts_eval"),
                 "--output_dir", d["grpo"]], logs, times)

    import transformers

    from common.task_eval import task_scores

    transformers.utils.logging.disable_progress_bar()  # one "Loading weights" bar per model is noise here
    scores = {stage: task_scores(d[stage], task("prompts_eval")) for stage in ("base", "sft", "grpo")}
    rollouts = [json.loads(line) for line in open(os.path.join(d["grpo"], "metrics.jsonl"))]
    rewards = [r["objective/scores"] for r in rollouts if "objective/scores" in r]
    # GRPO's final evaluation: vLLM's greedy answers, each with its prompt's image, as ppo_ray.py's engines sample
    grpo_eval = next(r["eval/reward"] for r in reversed(rollouts) if "eval/reward" in r)
    summary = {"seed": args.seed, "held_out": scores, "grpo_eval_reward": grpo_eval,
               "grpo_rollout_reward": {"first": rewards[0], "last": rewards[-1]},
               "seconds": {k: round(v) for k, v in times.items()}, "load_at_start": load, "machine": machine()}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [f"Held-out scenes ({NUM_EVAL}), greedy: accuracy (answered with a number)", "",
             "| model | accuracy | answered |", "|---|---|---|"]
    lines += [f"| {stage} | {s['accuracy']:.0%} | {s['answered']:.0%} |" for stage, s in scores.items()]
    lines += ["", f"GRPO's rollouts: mean reward {rewards[0]:.2f} at its first step, {rewards[-1]:.2f} at its last.",
              f"Seed {args.seed}, {time.time() - started:.0f} s on a {machine()} (load {load:.1f} at the start)."]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
