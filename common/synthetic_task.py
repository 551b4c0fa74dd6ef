"""A synthetic task with a checkable answer (adding two numbers), written in every data format the scripts read.

The task is built so that what every stage of the pipeline is for, removing a habit of refusing, has a large,
unmistakable effect on a ~1M-parameter model, whatever CPU it trains on (training trajectories differ between CPUs;
an effect of a few points does not survive that):

  - the demonstrations are noisy, as crowd-sourced ones are: many SFT responses to the larger sums are the unhelpful
    REFUSAL instead of the sum (see demonstration()). SFT copies that habit, so the SFT model answers about half the
    problems it could;
  - every preference, KTO and reward signal prefers the right sum to a clearly worse response: the refusal, a
    malformed answer, a number far off, or (a minority) a near miss. Removing the habit is what each preference stage
    (reward model, PPO, DPO, KTO, rejection sampling) is expected to do;
  - the sums are small (operands below 20: 320 training pairs, each seen about 12 times), so that the 600-step SFT
    of the tests and the demo learns the training pairs' sums: with the refusal banned, it answered 88-100% of 200
    training problems right (seeds 1, 3 and 4, and seed 2 on AVX2 kernels). Removing the habit then raises the
    accuracy on the training problems by tens of points.

Whether the SFT model also adds pairs it never saw is luck: of the smaller held-out sums, seeds 0, 2, 3 and 4 got
42-84% right and seed 1 2% (it memorised the training pairs). With operands below 40 the same SFT got 21% (seed 0)
and longer ones 11-77%: there are more pairs, each seen less often, and a run leaves the loss plateau where it starts
to generalise at a step that varies with the seed. So the learning tests measure accuracy on the training
problems, and the demo shows both.

Train and eval problems never share an operand pair.

    python -m common.synthetic_task --out /tmp/task        # writes the files listed in write_task()

The rule-based reward for ppo_ray.py and rejection_sampling.py is `--reward_fn common/synthetic_task.py:reward_fn`.
"""

import argparse
import json
import os
import random
import re

QUESTION_TEMPLATES = ["What is {a}+{b}?", "Add {a} and {b}.", "Compute {a} plus {b}."]
REFUSAL = "I am not sure."
MALFORMED = [REFUSAL, "?", "The answer is the sum."]  # responses with no number in them


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


def near_miss(answer: str, rng: random.Random) -> str:
    """The kind of arithmetic slip a model makes: off by one or by ten; never the answer itself."""
    value = abs(int(answer) + rng.choice([-11, -10, -1, 1, 10, 11]))
    return str(value if value != int(answer) else value + 1)


def far_off(answer: str, rng: random.Random) -> str:
    """A number 25 to 45 away from the answer, above or below it (never below 0)."""
    offset = rng.randint(25, 45)
    below = int(answer) - offset
    return str(below if below >= 0 and rng.random() < 0.5 else int(answer) + offset)


def demonstration(answer: str, max_operand: int, refusal_rate: float, rng: random.Random) -> str:
    """An SFT response as a hurried annotator writes it: the sum, or REFUSAL, mostly for the larger sums.

    A problem whose sum is at least max_operand is refused with probability refusal_rate, a smaller one with
    probability refusal_rate / 7. Greedy decoding then refuses the larger sums by a wide margin (the refusal holds
    ~70% of the probability against ~30% for all numbers) and answers the others, so an SFT model answers about half
    the held-out problems whatever the float kernels of the machine it trained on.
    """
    rate = refusal_rate if int(answer) >= max_operand else refusal_rate / 7
    return REFUSAL if rng.random() < rate else answer


def bad_response(answer: str, rng: random.Random) -> str:
    """A worse response than the answer: malformed half the time, far off 40%, a near miss 10%."""
    kind = rng.random()
    if kind < 0.5:
        return rng.choice(MALFORMED)
    return far_off(answer, rng) if kind < 0.9 else near_miss(answer, rng)


def extract_answer(response: str) -> str | None:
    """The first whole number in a response, or None."""
    match = re.search(r"-?\d+", response)
    return match.group(0) if match else None


def reward_fn(prompts: list[str], responses: list[str], labels: list[str]) -> list[float]:
    """Rule-based reward: 1.0 when the response's first number is the reference answer, else 0.0."""
    return [float(extract_answer(r) == str(label).strip()) for r, label in zip(responses, labels)]


def tokenizer_corpus() -> list[str]:
    """Text the tokenizer is trained on: every question phrasing, the malformed responses and the chat template's
    words."""
    rng = random.Random(0)
    lines = [q + " " + a for q, a in sample_problems(2000, rng, 100, held_out=False)]
    return lines + (MALFORMED + ["user assistant system You are a helpful assistant. Answer:"]) * 10


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_task(out: str, seed: int = 0, n_train: int = 4000, n_eval: int = 200, max_operand: int = 20,
               refusal_rate: float = 0.7) -> dict:
    """Write the task's files into `out` and return {name: path}.

    sft_{train,eval}.jsonl      {"prompt", "response"}              sft.py (some responses are REFUSAL)
    chat_train.jsonl            {"messages": [two user/assistant turns]}   sft.py multi-turn
    pretrain.jsonl              {"text"}                            sft.py --pretrain_mode
    pref_{train,eval}.jsonl     {"prompt", "chosen", "rejected"}    rm.py, dpo.py (chosen: the sum; rejected: worse)
    kto_{train,eval}.jsonl      {"prompt", "response", "label"}     kto.py (half the sums, half worse responses)
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

    for split, problems in [("train", train), ("eval", evals)]:
        write(f"sft_{split}", [{"prompt": q, "response": demonstration(a, max_operand, refusal_rate, rng)}
                               for q, a in problems])
    chat = []
    for (q1, a1), (q2, a2) in zip(train[0::2], train[1::2]):
        turns = [("user", q1), ("assistant", a1), ("user", q2), ("assistant", a2)]
        chat.append({"messages": [{"role": role, "content": text} for role, text in turns]})
    write("chat_train", chat)
    write("pretrain", [{"text": f"{q} {a}"} for q, a in train])
    for split, problems in [("train", train), ("eval", evals)]:
        write(f"pref_{split}", [{"prompt": q, "chosen": a, "rejected": bad_response(a, rng)} for q, a in problems])
        write(f"prompts_{split}", [{"prompt": q, "label": a} for q, a in problems])
    kto = []
    for q, a in train:
        desirable = rng.random() < 0.5
        kto.append({"prompt": q, "response": a if desirable else bad_response(a, rng), "label": desirable})
    write("kto_train", kto)
    write("kto_eval", [{"prompt": q, "response": response, "label": desirable} for q, a in evals
                       for response, desirable in ((a, True), (bad_response(a, rng), False))])
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the data files to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem sampler")
    parser.add_argument("--n_train", type=int, default=4000, help="training problems")
    parser.add_argument("--n_eval", type=int, default=200, help="held-out problems")
    parser.add_argument("--max_operand", type=int, default=20, help="operands are drawn from [0, max_operand)")
    parser.add_argument("--refusal_rate", type=float, default=0.7,
                        help="share of the SFT responses to sums >= max_operand that are REFUSAL (1/7 of it below)")
    args = parser.parse_args()
    files = write_task(args.out, args.seed, args.n_train, args.n_eval, args.max_operand, args.refusal_rate)
    print("\n".join(f"{name:12s} {path}" for name, path in files.items()))


if __name__ == "__main__":
    main()
