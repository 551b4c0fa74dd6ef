"""A synthetic task with a checkable answer (adding two numbers), written in every data format the scripts read.

A ~1M-parameter model learns it on a CPU in minutes, and a short SFT leaves it far from perfect, so the later
stages (reward model, DPO, KTO, PPO, rejection sampling) have room to show a measurable gain. Train and eval
problems never share an operand pair.

    python -m common.synthetic_task --out /tmp/task        # writes the files listed in write_task()

The rule-based reward for ppo_ray.py and rejection_sampling.py is `--reward_fn common/synthetic_task.py:reward_fn`.
"""

import argparse
import json
import os
import random
import re

QUESTION_TEMPLATES = ["What is {a}+{b}?", "Add {a} and {b}.", "Compute {a} plus {b}."]


def is_held_out(a: int, b: int) -> bool:
    """One operand pair in five is kept for evaluation; the split is a fixed function of the pair."""
    return (a * 7 + b * 13) % 5 == 0


def sample_problems(n: int, rng: random.Random, max_operand: int, held_out: bool) -> list[tuple[str, str]]:
    """n (question, answer) pairs, drawn with replacement from the train or the eval side of the split."""
    problems = []
    while len(problems) < n:
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        if is_held_out(a, b) == held_out:
            template = rng.choice(QUESTION_TEMPLATES)
            problems.append((template.format(a=a, b=b), str(a + b)))
    return problems


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A near miss, the kind of mistake the model makes: off by one or by ten."""
    value = abs(int(answer) + rng.choice([-11, -10, -1, 1, 10, 11]))
    return str(value if value != int(answer) else value + 1)


def extract_answer(response: str) -> str | None:
    """The first whole number in a response, or None."""
    match = re.search(r"-?\d+", response)
    return match.group(0) if match else None


def reward_fn(prompts: list[str], responses: list[str], labels: list[str]) -> list[float]:
    """Rule-based reward: 1.0 when the response's first number is the reference answer, else 0.0."""
    return [float(extract_answer(r) == str(label).strip()) for r, label in zip(responses, labels)]


def tokenizer_corpus() -> list[str]:
    """Text the tokenizer is trained on: every question phrasing and the chat template's words."""
    rng = random.Random(0)
    lines = [q + " " + a for q, a in sample_problems(2000, rng, 100, held_out=False)]
    return lines + ["user assistant system You are a helpful assistant. Answer:"] * 10


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_task(out: str, seed: int = 0, n_train: int = 4000, n_eval: int = 200, max_operand: int = 50) -> dict:
    """Write the task's files into `out` and return {name: path}.

    sft_{train,eval}.jsonl      {"prompt", "response"}              sft.py
    chat_train.jsonl            {"messages": [two user/assistant turns]}   sft.py multi-turn
    pretrain.jsonl              {"text"}                            sft.py --pretrain_mode
    pref_{train,eval}.jsonl     {"prompt", "chosen", "rejected"}    rm.py, dpo.py
    kto_train.jsonl             {"prompt", "response", "label"}     kto.py
    prompts_{train,eval}.jsonl  {"prompt", "label"}                 ppo_ray.py, rejection_sampling.py
    """
    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    train = sample_problems(n_train, rng, max_operand, held_out=False)
    evals = sample_problems(n_eval, rng, max_operand, held_out=True)
    files = {}

    def write(name, rows):
        files[name] = os.path.join(out, name + ".jsonl")
        _write_jsonl(files[name], rows)

    write("sft_train", [{"prompt": q, "response": a} for q, a in train])
    write("sft_eval", [{"prompt": q, "response": a} for q, a in evals])
    chat = []
    for (q1, a1), (q2, a2) in zip(train[0::2], train[1::2]):
        turns = [("user", q1), ("assistant", a1), ("user", q2), ("assistant", a2)]
        chat.append({"messages": [{"role": role, "content": text} for role, text in turns]})
    write("chat_train", chat)
    write("pretrain", [{"text": f"{q} {a}"} for q, a in train])
    for split, problems in [("train", train), ("eval", evals)]:
        write(f"pref_{split}", [{"prompt": q, "chosen": a, "rejected": wrong_answer(a, rng)} for q, a in problems])
        write(f"prompts_{split}", [{"prompt": q, "label": a} for q, a in problems])
    kto = []
    for q, a in train:
        desirable = rng.random() < 0.5
        kto.append({"prompt": q, "response": a if desirable else wrong_answer(a, rng), "label": desirable})
    write("kto_train", kto)
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the data files to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem sampler")
    parser.add_argument("--n_train", type=int, default=4000, help="training problems")
    parser.add_argument("--n_eval", type=int, default=200, help="held-out problems")
    parser.add_argument("--max_operand", type=int, default=50, help="operands are drawn from [0, max_operand)")
    args = parser.parse_args()
    files = write_task(args.out, args.seed, args.n_train, args.n_eval, args.max_operand)
    print("\n".join(f"{name:12s} {path}" for name, path in files.items()))


if __name__ == "__main__":
    main()
