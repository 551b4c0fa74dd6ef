"""GRPO on a real pretrained chat model, SmolLM2-135M-Instruct, on a 2-core CPU: it learns to answer arithmetic
questions right that it got wrong, on questions it never trained on (about three and a half minutes on 2 cores no
other run shares; its GRPO computes each question once for its 4 samples, --share_prompts).

    python -m common.real_model                 the model as a plain fp32 folder (built once into .cache/)
    python -m common.synthetic_task --max_operand 10    single-digit sums, with held-out operand pairs
    python ppo_ray.py ... --reward_fn launch/right_answer_reward.py:reward_fn --advantage_estimator grpo

The reward (launch/right_answer_reward.py) pays correctness alone: 1.0 when the response's last number is the sum,
0.0 otherwise, whatever the form. The demo answers held-out questions (operand pairs GRPO never sees) greedily with
plain transformers before and after, and writes into the output folder summary.md (held-out answers side by side, the
numbers) and reward_curve.png (the rollouts' share of right answers and response length by step). With
--update_docs it writes its results into README.md and docs/real_model.md between the `<!-- demo-real-results -->`
markers. A run is seeded: the same machine prints the same results twice; --seed picks another GRPO trajectory.

    python launch/demo_real.py --out out/demo_real
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from launch.demo import machine, moving_average, run  # noqa: E402  (the toy demo's stage runner and helpers)
from launch.right_answer_reward import is_right  # noqa: E402

PY = sys.executable
REWARD = "launch/right_answer_reward.py:reward_fn"
DOCS = ["README.md", "docs/real_model.md"]
STEPS = 24  # GRPO steps; docs/real_model.md has the curve of every step under four seeds
# Sums of two numbers below 10: the base model knows most of them but loses its way in a paragraph about "the formula
# for adding integers" on half the questions, and samples the right answer about a third of the time (the sanity
# run's band, docs/real_model.md); with operands below 20 it samples the right sum too rarely to learn in minutes.
MAX_OPERAND = 10
GENERATE_MAX_LEN = 32  # tokens; the base model's long answers are cut here, during training and when scored
# ppo_ray.py's settings besides the model, data and seed; docs/real_model.md says why each.
GRPO_FLAGS = ["--apply_chat_template", "--reward_fn", REWARD, "--advantage_estimator", "grpo",
              "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
              "--micro_train_batch_size", "8", "--actor_learning_rate", "5e-5", "--temperature", "0.7",
              "--init_kl_coef", "0", "--prompt_max_len", "64", "--generate_max_len", str(GENERATE_MAX_LEN)]


def held_out_questions(prompts_file: str, n: int) -> list[dict]:
    """The first n distinct questions of a {"prompt", "label"} file (the task draws its questions with replacement)."""
    from common.data import load_records
    from common.solve_rate import distinct

    return distinct(load_records(prompts_file))[:n]


def answer(model_dir: str, rows: list[dict]) -> dict:
    """Greedy answers to `rows`' prompts, which of them are right (the last number is the label), the share right
    and the mean words per answer."""
    import transformers

    from common.task_eval import greedy_responses

    transformers.utils.logging.disable_progress_bar()
    responses = greedy_responses(model_dir, [r["prompt"] for r in rows], max_new_tokens=GENERATE_MAX_LEN)
    right = [is_right(response, row["label"]) for response, row in zip(responses, rows)]
    return {"responses": responses, "right": right, "accuracy": statistics.mean(right),
            "words": statistics.mean(len(r.split()) for r in responses)}


def plot(metrics_file: str, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in map(json.loads, open(metrics_file)) if "objective/scores" in r]
    steps = [r["step"] for r in rows]
    scores = [r["objective/scores"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, scores, marker=".", alpha=0.4, label="per step")
    ax1.plot(steps, moving_average(scores, 3), linewidth=2, label="moving average (3 steps)")
    ax1.set(title="GRPO: share of sampled answers right", xlabel="GRPO step", ylabel="objective/scores",
            ylim=(0, 1))
    ax1.legend()
    ax2.plot(steps, [r["response/length"] for r in rows], marker=".", color="tab:green")
    ax2.set(title="response length", xlabel="GRPO step", ylabel="tokens per response")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def cell(text: str, limit: int = 70) -> str:
    """A response as one markdown table cell: one line, pipes escaped, cut at `limit` characters."""
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text[:limit]}{'...' if len(text) > limit else ''}`" if text else "(nothing)"


def update_docs(block: str) -> list[str]:
    """Replace what stands between `<!-- demo-real-results -->` and `<!-- /demo-real-results -->` in DOCS."""
    changed = []
    for name in DOCS:
        path = os.path.join(ROOT, name)
        text = open(path).read()
        new = re.sub(r"<!-- demo-real-results -->.*?<!-- /demo-real-results -->",
                     lambda _: f"<!-- demo-real-results -->\n{block}\n<!-- /demo-real-results -->", text, flags=re.S)
        if new != text:
            open(path, "w").write(new)
            changed.append(name)
    return changed


def mark(response: str, right: bool) -> str:
    return f"{cell(response)} {'right' if right else 'wrong'}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo_real", help="output folder (emptied first)")
    parser.add_argument("--steps", type=int, default=STEPS, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=0, help="GRPO's seed (the questions stay the same)")
    parser.add_argument("--eval_prompts", type=int, default=64, help="held-out questions answered before and after")
    parser.add_argument("--show", type=int, default=8, help="held-out answers printed side by side (the first ones)")
    parser.add_argument("--update_docs", action="store_true", help="write the results into README.md and docs/")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    logs = os.path.join(out, "logs")
    os.makedirs(logs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    task, grpo = os.path.join(out, "task"), os.path.join(out, "grpo")
    started, times, load = time.time(), {}, os.getloadavg()[0]  # other jobs on the cores slow every stage down

    run("setup", [PY, "-m", "common.real_model"], logs, times)
    run("task", [PY, "-m", "common.synthetic_task", "--out", task, "--max_operand", str(MAX_OPERAND)], logs, times)
    from common.real_model import real_model_dir

    base = real_model_dir()
    held_out = held_out_questions(os.path.join(task, "prompts_eval.jsonl"), args.eval_prompts)
    print(f"\n[before] greedy answers of the base model to {len(held_out)} held-out questions", flush=True)
    start = time.time()
    before = answer(base, held_out)
    times["before"] = time.time() - start

    run("grpo", [PY, "ppo_ray.py", "--pretrain", base, "--prompt_data", os.path.join(task, "prompts_train.jsonl"),
                 *GRPO_FLAGS, "--share_prompts", "--max_steps", str(args.steps), "--seed", str(args.seed),
                 "--output_dir", grpo],
        logs, times)

    print(f"\n[after] greedy answers of the GRPO model to the same {len(held_out)} questions", flush=True)
    start = time.time()
    after = answer(grpo, held_out)
    times["after"] = time.time() - start
    plot(os.path.join(grpo, "metrics.jsonl"), os.path.join(out, "reward_curve.png"))
    scores = [r["objective/scores"] for r in map(json.loads, open(os.path.join(grpo, "metrics.jsonl")))
              if "objective/scores" in r]
    window = max(1, min(6, len(scores) // 2))
    first, last = scores[0], statistics.mean(scores[-window:])  # step 1 samples the base model

    table = ["| held-out question | before (SmolLM2-135M-Instruct) | after GRPO |", "|---|---|---|"]
    table += [f"| {row['prompt']} (= {row['label']}) | {mark(b, b_ok)} | {mark(a, a_ok)} |"
              for row, b, b_ok, a, a_ok in list(zip(held_out, before["responses"], before["right"],
                                                    after["responses"], after["right"]))[:args.show]]
    fixed = sum(a and not b for a, b in zip(after["right"], before["right"]))
    broken = sum(b and not a for a, b in zip(after["right"], before["right"]))
    numbers = ["| | before | after GRPO |", "|---|---|---|",
               f"| held-out questions answered right (greedy) | {before['accuracy']:.0%} | {after['accuracy']:.0%} |",
               f"| training questions answered right (GRPO's samples: step 1 / the last {window} steps) | "
               f"{first:.0%} | {last:.0%} |",
               f"| words per held-out answer | {before['words']:.1f} | {after['words']:.1f} |"]
    results = "\n".join([
        *table, "", *numbers, "",
        f"{len(held_out)} distinct held-out questions (operand pairs GRPO never saw), answered greedily, at most "
        f"{GENERATE_MAX_LEN} tokens; right means the answer's last number is the sum. GRPO made {fixed} wrong answers "
        f"right and {broken} right ones wrong. The reward pays a right answer 1 and anything else 0 ({args.steps} "
        f"steps of 8 questions x 4 samples, seed {args.seed}).",
    ])
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    timing = (f"`make demo-real` on a {machine()}, {time.strftime('%Y-%m-%d')}: {time.time() - started:.0f} s in "
              f"all (" + ", ".join(f"{k} {v:.0f}" for k, v in times.items() if v >= 1) + f" s; OMP_NUM_THREADS "
              f"{threads}; load average {load:.1f} when it started).")
    rel = os.path.relpath
    summary = "\n".join([
        "# Real-model demo results", "",
        "SmolLM2-135M-Instruct, GRPO with a reward for right answers alone.", "", results, "",
        timing, "", f"Curve: {rel(os.path.join(out, 'reward_curve.png'))}. Logs: {rel(logs)}. The trained "
        f"model and its metrics.jsonl: {rel(grpo)}.",
    ])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:  # for comparing seeds
        json.dump({"seed": args.seed, "first": first, "last": last, "scores": scores, "threads": threads,
                   "fixed": fixed, "broken": broken,
                   **{f"{k}_{when}": m[k] for when, m in (("before", before), ("after", after))
                      for k in ("accuracy", "words")}}, f)
    print("\n" + summary)
    if args.update_docs:
        changed = update_docs(results + "\n\n" + timing)
        print(f"\nwrote the results into {', '.join(changed) or 'no file (no markers found)'}")


if __name__ == "__main__":
    main()
