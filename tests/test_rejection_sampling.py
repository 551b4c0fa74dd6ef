"""rejection_sampling.py: selection (a property test over random rewards with ties), bad input, and end-to-end runs
on the synthetic task with the real stack (Ray, a vLLM engine, sft.py and dpo.py as subprocesses).

The end-to-end runs start from the short SFT model of conftest.py and share one generation: the best-of-n run samples
1000 training prompts x 8, and the conditional-SFT and DPO runs start from copies of its sample files, which is what a
resumed run does (they hold the same policy's samples for the same prompts). The DPO run then samples its second
iteration from its own first model, and is killed and resumed in that iteration.
"""

import json
import os
import random
import shutil
import signal
import sys
import time

import pytest
import torch
from conftest import ROOT, SEED, expect, kill_group, metrics, run_script, training_problem_scores
from test_rewards import write_reward_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.args import UserError, parse_args
from common.data import load_records, render_prompt
from common.modeling import token_logprobs
from common.rewards import load_reward_model, reward_model_scores
from common.synthetic_task import REFUSAL, extract_answer, reward_fn
from common.task_eval import greedy_responses
from common.tiny_model import build_tokenizer
from rejection_sampling import (TRAINER_BATCH_SIZE, Args, conditioned_prompt, load_state, main, round_policy, select,
                                train_command, trainer_batch_size)

TEMPLATE = "{prompt} <rm_score>: {reward}"
REWARD_FN = os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn"


def rs_args(model, task, out, *extra):
    """Sampling settings of every run here: short answers, a small context, 8 samples per prompt."""
    return ["--pretrain", model, "--dataset", task["prompts_train"], "--apply_chat_template", "--output_dir", out,
            "--n_samples_per_prompt", "8", "--generate_max_len", "8", "--max_model_len", "128", "--enforce_eager",
            "--reward_fn", REWARD_FN, "--seed", str(SEED), *extra]


def greedy_scores(model, prompts, labels) -> dict:
    """Greedy accuracy and the share of answers with a number in them."""
    responses = greedy_responses(model, prompts)
    return {"accuracy": sum(reward_fn(prompts, responses, labels)) / len(prompts),
            "answered": sum(extract_answer(r) is not None for r in responses) / len(prompts)}


@torch.no_grad()
def refusal_logprobs(model_dir: str, prompts: list[str]) -> torch.Tensor:
    """log p(REFUSAL | prompt) under the chat template, one per prompt."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    response = tokenizer(REFUSAL, add_special_tokens=False)["input_ids"]
    out = []
    for prompt in prompts:
        ids = tokenizer(render_prompt(tokenizer, prompt, True, None), add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([ids + response])).logits[0, len(ids) - 1:-1]
        out.append(token_logprobs(logits, torch.tensor(response)).sum())
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------------ selection
def test_selection_keeps_a_maximum_reward_sample_for_every_prompt():
    rng = random.Random(0)
    for _ in range(500):
        num_prompts, n = rng.randint(1, 6), rng.randint(1, 6)
        levels = [round(rng.uniform(-3, 3), 2) for _ in range(rng.randint(1, 3))]  # few values: many ties
        scores = [[rng.choice(levels) for _ in range(n)] for _ in range(num_prompts)]
        prompts = [f"prompt {i}" for i in range(num_prompts)]
        responses = [[f"response {i}.{j}" for j in range(n)] for i in range(num_prompts)]

        best, skipped = select("best_of_n", prompts, responses, scores)
        assert skipped == 0 and [r["prompt"] for r in best] == prompts
        for record, texts, s in zip(best, responses, scores):
            assert record["reward"] == max(s) == s[texts.index(record["response"])]

        threshold = rng.choice(levels)
        kept, skipped = select("best_of_n", prompts, responses, scores, min_reward=threshold)
        assert [r["prompt"] for r in kept] == [p for p, s in zip(prompts, scores) if max(s) >= threshold]
        assert skipped == num_prompts - len(kept)

        pairs, skipped = select("dpo_pairs", prompts, responses, scores)
        assert [r["prompt"] for r in pairs] == [p for p, s in zip(prompts, scores) if max(s) > min(s)]
        assert skipped == num_prompts - len(pairs)
        for record in pairs:
            i = prompts.index(record["prompt"])
            assert record["chosen_reward"] == max(scores[i]) == scores[i][responses[i].index(record["chosen"])]
            assert record["rejected_reward"] == min(scores[i]) == scores[i][responses[i].index(record["rejected"])]

        csft, skipped = select("csft", prompts, responses, scores, csft_template=TEMPLATE, csft_decimals=2)
        assert skipped == 0 and len(csft) == num_prompts * n
        for record, (i, j) in zip(csft, [(i, j) for i in range(num_prompts) for j in range(n)]):
            assert record == {"prompt": f"prompt {i} <rm_score>: {scores[i][j]:.2f}", "response": responses[i][j],
                              "reward": scores[i][j]}


def test_pairs_need_two_different_texts_and_ties_go_to_the_first():
    pairs, skipped = select("dpo_pairs", ["p"], [["same", "same"]], [[1.0, 0.0]])
    assert pairs == [] and skipped == 1
    best, _ = select("best_of_n", ["p"], [["a", "b", "c"]], [[0.0, 1.0, 1.0]])
    assert best[0]["response"] == "b"


def test_responses_cut_at_the_length_limit_are_not_answers_but_may_be_rejected():
    """A cut response would be trained on with an EOS after it, teaching the model to stop where the limit cut it:
    the best whole response is picked instead, and a prompt with none gives no record. A pair may reject a cut one
    (a rambling answer is a wrong one), and says so, for dpo.py to train it without an end."""
    prompts, responses = ["p", "q"], [["cut, best", "whole", "whole, worst"], ["cut", "cut too", "cut, worst"]]
    scores, truncated = [[3.0, 2.0, 0.0], [1.0, 0.5, 0.0]], [[True, False, False], [True, True, True]]
    best, skipped = select("best_of_n", prompts, responses, scores, truncated=truncated)
    assert best == [{"prompt": "p", "response": "whole", "reward": 2.0}] and skipped == 1
    pairs, skipped = select("dpo_pairs", prompts, responses, scores, truncated=truncated)
    assert [(r["chosen"], r["rejected"]) for r in pairs] == [("whole", "whole, worst")] and skipped == 1
    csft, skipped = select("csft", prompts, responses, scores, csft_template=TEMPLATE, truncated=truncated)
    assert [r["response"] for r in csft] == ["whole", "whole, worst"] and skipped == 1
    kept, _ = select("best_of_n", prompts, responses, scores, truncated=truncated, keep_truncated=True)
    assert [r["response"] for r in kept] == ["cut, best", "cut"]

    rambling = [[False, True, False]]  # the worst sample is the one the limit cut
    [pair], _ = select("dpo_pairs", ["p"], [["right", "rambling", "wrong"]], [[1.0, 0.0, 0.5]], truncated=rambling)
    assert (pair["chosen"], pair["chosen_truncated"], pair["rejected"], pair["rejected_truncated"]) == \
        ("right", False, "rambling", True)
    [pair], _ = select("dpo_pairs", ["p"], [["right", "rambling", "wrong"]], [[0.0, 1.0, 0.5]], truncated=rambling,
                       keep_truncated=True)
    assert (pair["chosen"], pair["chosen_truncated"], pair["rejected_truncated"]) == ("rambling", True, False)


def test_the_reward_is_written_into_the_prompt_once_spelled():
    assert conditioned_prompt("What is 2+3?", -0.04, TEMPLATE, 1) == "What is 2+3? <rm_score>: 0.0"
    assert conditioned_prompt("Q", 1.23456, TEMPLATE, 2) == "Q <rm_score>: 1.23"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "What is 2+3?"}]
    conditioned = conditioned_prompt(chat, 2.0, TEMPLATE, 1)
    assert conditioned[:3] == chat[:3] and conditioned[3]["content"] == "What is 2+3? <rm_score>: 2.0"
    assert chat[3]["content"] == "What is 2+3?"  # the caller's prompt is left as it was


def test_a_reward_model_reads_what_its_own_template_renders(tiny_model, task, tmp_path):
    """As rm.py trained it: a reward model saved with another chat template than the policy's (same vocabulary and
    EOS, which main checks) reads prompt + response rendered with its own template, not the policy's. Scores are
    summed in float64: a rule's 0.7 stays 0.7, which --min_reward 0.7 keeps."""
    from rejection_sampling import score

    rm_dir = write_reward_model(tiny_model, str(tmp_path / "rm"), tokenizer=build_tokenizer(chat_format="chatml"))
    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = parse_args(Args, rs_args(tiny_model, task, str(tmp_path / "out"), "--reward_pretrain", rm_dir,
                                    "--n_samples_per_prompt", "2"))
    args.reward_fn = None
    prompts, labels, responses = ["What is 2+3?", "Add 4 and 4."], ["5", "8"], [["5", "6"], ["8", "eight"]]
    scores = score(args, prompts, labels, responses, None, "score")
    model, rm_tokenizer = load_reward_model(rm_dir)
    flat = [r for texts in responses for r in texts]
    expected = reward_model_scores(model, rm_tokenizer, [p for p in prompts for _ in range(2)], flat, True)
    policys = reward_model_scores(model, policy_tokenizer, [p for p in prompts for _ in range(2)], flat, True)
    assert [s for row in scores for s in row] == pytest.approx(expected, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(expected, policys)) > 1e-3  # the templates do read differently
    args.reward_pretrain, args.reward_weights, args.reward_fn = [], None, "rule.py:reward"
    rule = lambda prompts, responses, labels: [0.7] * len(responses)
    assert score(args, prompts, labels, responses, rule, "score") == [[0.7, 0.7], [0.7, 0.7]]


def test_training_runs_as_a_user_would_type_it():
    args = Args(pretrain="p", mode="dpo_pairs", apply_chat_template=True, train_args="--max_steps 5 --beta 0.2",
                train_num_gpus=2, max_model_len=1536)
    command = train_command(args, "out/iter_0/model", "out/iter_1/dpo_pairs.jsonl", "out/iter_1/model")
    assert command == [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                       os.path.join(ROOT, "dpo.py"), "--pretrain", "out/iter_0/model", "--dataset",
                       "out/iter_1/dpo_pairs.jsonl", "--output_dir", "out/iter_1/model", "--apply_chat_template",
                       "--max_len", "1536", "--max_steps", "5", "--beta", "0.2"]
    args = Args(pretrain="p", input_template="Q: {} A: ", max_model_len=2048, train_args="--max_len=4096")
    assert train_command(args, "p", "d.jsonl", "m") == [sys.executable, os.path.join(ROOT, "sft.py"), "--pretrain",
                                                        "p", "--dataset", "d.jsonl", "--output_dir", "m",
                                                        "--input_template", "Q: {} A: ", "--max_len=4096"]


def test_the_trainer_keeps_a_selected_response_the_engines_could_write_whole(tiny_model, tmp_path):
    """A response of 600 tokens fits the engines' --max_model_len 1024, and rejection sampling selects it as
    finished; sft.py's default --max_len 512 cut it, and its EOS, so the policy learned to run on."""
    import sft
    from common import data

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": "1+6?", "response": " ".join(["7"] * 300)}]  # 600 tokens
    args = Args(pretrain=tiny_model, max_model_len=1024, apply_chat_template=True)
    command = train_command(args, tiny_model, "sft.jsonl", "m")
    max_len = int(command[command.index("--max_len") + 1])
    logged = []
    (sample,) = data.build_sft_samples(rows, tokenizer, "sft.jsonl", "prompt", "response", max_len, True,
                                       log=logged.append)
    assert sample["input_ids"][-1] == tokenizer.eos_token_id and not logged
    assert len(sample["input_ids"]) > sft.Args().max_len, "the default would not have cut it: no test"


# ------------------------------------------------------------------------------------------------------ bad input
@pytest.mark.slow
def test_bad_input_is_one_clear_sentence_before_anything_is_written(tiny_model, task, tmp_path):
    other_tokenizer_rm = write_reward_model(tiny_model, str(tmp_path / "other_rm"), tokenizer=build_tokenizer(300))
    out = str(tmp_path / "out")
    cases = {
        "--mode dpo_pairs needs --n_samples_per_prompt of at least 2":
            ["--mode", "dpo_pairs", "--n_samples_per_prompt", "1"],
        f"--reward_pretrain {other_tokenizer_rm} has a different tokenizer from the policy --pretrain {tiny_model}":
            ["--reward_pretrain", other_tokenizer_rm],
        "do not fit the engine's context: prompt 0 has": ["--max_model_len", "16"],
        "no function 'score'": ["--reward_fn", REWARD_FN.replace("reward_fn", "score")],
        "--reward_weights has 1 weights for 2 reward sources": ["--remote_rm_url", "http://127.0.0.1:1/r",
                                                               "--reward_weights", "1.0"],
        "--min_reward drops prompts in best_of_n and dpo_pairs": ["--mode", "csft", "--min_reward", "1.0"],
        "--prompts_per_iteration splits the prompts among the rounds of --iterations": ["--prompts_per_iteration",
                                                                                        "10"],
    }
    for message, override in cases.items():
        args = parse_args(Args, rs_args(tiny_model, task, out, "--max_samples", "20") + override)
        with pytest.raises(UserError) as error:
            main(args)
        assert message in str(error.value) and str(error.value).count(". ") == 0, str(error.value)
        assert not os.path.exists(out)
    # the same from the command line: exit code 2 and one line
    result = run_script("rejection_sampling.py", rs_args(tiny_model, task, out, "--max_model_len", "16"), check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "raise --max_model_len" in errors[0], result.stderr[-2000:]
    assert not os.path.exists(out)


def test_a_round_samples_the_latest_model_a_round_trained(tmp_path):
    """A round whose samples all tie (every answer right, or every one wrong) gives no record and trains no model:
    the next round samples the latest model an earlier round trained, not a folder that was never written."""
    args = Args(pretrain="base", dataset="d.jsonl", output_dir=str(tmp_path / "run"), iterations=4)
    assert round_policy(args, 0) == round_policy(args, 1) == "base"
    os.makedirs(tmp_path / "run" / "iter_0" / "model")
    assert round_policy(args, 1) == round_policy(args, 2) == str(tmp_path / "run" / "iter_0" / "model")
    os.makedirs(tmp_path / "run" / "iter_2" / "model")  # round 1 tied everywhere, round 2 trained again
    assert round_policy(args, 3) == str(tmp_path / "run" / "iter_2" / "model")


def test_a_round_knows_its_trainers_batch_size():
    import dpo
    import sft

    assert TRAINER_BATCH_SIZE == sft.Args.train_batch_size == dpo.Args.train_batch_size
    batch = lambda train_args: trainer_batch_size(Args(pretrain="p", dataset="d", train_args=train_args))
    assert batch("") == TRAINER_BATCH_SIZE and batch("--beta 0.1 --train_batch_size 8") == 8
    assert batch("--train_batch_size=4 --max_len 64") == 4
    with pytest.raises(UserError, match="--train_args gives --train_batch_size 'eight'; give a whole number."):
        batch("--train_batch_size eight")


# Round 0: a pair for every prompt whose samples differ (the first sample's text against another); round 1: one
# such pair; later rounds: all tied. Responses come prompt-major, 8 a prompt, in one call a round.
ONE_PAIR_FEWER_EACH_ROUND = """import itertools

CALLS = itertools.count()


def reward_fn(prompts, responses, labels):
    call, rewards, paired = next(CALLS), [], 0
    for start in range(0, len(responses), 8):
        group = responses[start:start + 8]
        pair = len(set(group)) > 1 and (call == 0 or (call == 1 and not paired))
        paired += pair
        rewards += [float(text == group[0]) if pair else 1.0 for text in group]
    return rewards
"""


@pytest.mark.slow
@pytest.mark.extended
def test_a_round_with_nothing_to_learn_is_logged_and_the_next_samples_the_last_model(sft_model, task, tmp_path):
    """Iterative DPO near convergence: a round left with less than a batch of pairs (round 1: one pair, round 2:
    none) is logged (its rewards are the measurement a sanity run reads) and trains nothing; the run goes on from
    the last trained model and ends cleanly."""
    reward = tmp_path / "once.py"
    reward.write_text(ONE_PAIR_FEWER_EACH_ROUND)
    out = str(tmp_path / "run")
    args = rs_args(sft_model, task, out, "--max_samples", "16", "--mode", "dpo_pairs", "--iterations", "3",
                   "--reward_batch_size", "128", "--train_args",
                   "--max_steps 1 --train_batch_size 2 --micro_train_batch_size 2 --max_len 64")
    args[args.index("--reward_fn") + 1] = f"{reward}:reward_fn"
    result = run_script("rejection_sampling.py", args)
    records = [m["data/records"] for m in metrics(out)]
    assert len(records) == 3 and records[0] >= 2 and records[1:] == [1, 0], result.stdout[-2000:]
    assert [os.path.exists(os.path.join(out, f"iter_{k}", "model")) for k in range(3)] == [True, False, False]
    assert result.stdout.count(f"fewer than one batch of 2 to train on, so the next round samples {out}/iter_0/model "
                               f"again") == 2
    assert json.load(open(os.path.join(out, "state.json")))["finished_iterations"] == 3


def test_a_run_resumes_only_with_the_settings_it_started_with(tmp_path):
    args = Args(pretrain="p", dataset="d.jsonl", output_dir=str(tmp_path / "run"), iterations=2)
    assert load_state(args)["finished_iterations"] == 0
    more_rounds = Args(pretrain="p", dataset="d.jsonl", output_dir=args.output_dir, iterations=3, train_num_gpus=2)
    assert load_state(more_rounds)["finished_iterations"] == 0
    with pytest.raises(UserError, match="started with --n_samples_per_prompt 8, not 4; rerun with its settings"):
        load_state(Args(pretrain="p", dataset="d.jsonl", output_dir=args.output_dir, iterations=2,
                        n_samples_per_prompt=4))
    with pytest.raises(UserError, match="started with --generate_batch_size 256, not 64; rerun with its settings"):
        load_state(Args(pretrain="p", dataset="d.jsonl", output_dir=args.output_dir, iterations=2,
                        generate_batch_size=64))  # its chunks decide which engine samples which prompts
    with pytest.raises(UserError, match="started with --iterations 2; one with --iterations 0 cannot continue it"):
        load_state(Args(pretrain="p", dataset="d.jsonl", output_dir=args.output_dir, iterations=0))


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def best_of_n_run(sft_model, task, tmp_path_factory):
    """One iteration of best-of-8 (solved prompts only) + SFT from the SFT model, on 1000 training prompts."""
    out = str(tmp_path_factory.mktemp("best_of_n"))
    result = run_script("rejection_sampling.py", rs_args(
        sft_model, task, out, "--max_samples", "1000", "--min_reward", "1.0", "--iterations", "1", "--train_args",
        f"--max_steps 60 --micro_train_batch_size 16 --learning_rate 2e-4 --max_len 64 --logging_steps 20 "
        f"--seed {SEED}"))
    return out, result.stdout


@pytest.mark.slow
@pytest.mark.learning
def test_one_iteration_of_best_of_n_and_sft_beats_the_starting_model(best_of_n_run, sft_model, task):
    out, stdout = best_of_n_run
    records = load_records(os.path.join(out, "iter_0", "best_of_n.jsonl"))  # sft.py trained on it as it stands
    assert 100 < len(records) < 1000 and all(r["reward"] == 1.0 and set(r) == {"prompt", "response", "reward"}
                                             for r in records)
    log = metrics(out)
    assert len(log) == 1 and log[0]["rewards/best_mean"] > log[0]["rewards/mean"]
    assert log[0]["perf/generate_samples_per_sec"] > 0 and log[0]["time/train_share"] > 0
    assert json.load(open(os.path.join(out, "state.json")))["finished_iterations"] == 1
    before, after = (training_problem_scores(m, task) for m in (sft_model, os.path.join(out, "iter_0", "model")))
    print(f"greedy accuracy on training problems: SFT model {before}, after best-of-8 + SFT {after}")
    expect("best-of-n: share answered", after["answered"], ">=", 0.75)
    expect("best-of-n: accuracy gain over SFT", after["accuracy"] - before["accuracy"], ">=", 0.2)


@pytest.mark.slow
@pytest.mark.learning
def test_conditional_sft_answers_better_when_asked_for_a_high_reward(best_of_n_run, sft_model, task, tmp_path):
    samples, out = os.path.join(best_of_n_run[0], "iter_0"), str(tmp_path / "csft")
    os.makedirs(os.path.join(out, "iter_0"))
    for name in ("generations.jsonl", "scored.jsonl"):
        shutil.copy(os.path.join(samples, name), os.path.join(out, "iter_0", name))
    result = run_script("rejection_sampling.py", rs_args(
        sft_model, task, out, "--max_samples", "1000", "--mode", "csft", "--iterations", "1", "--train_args",
        f"--max_steps 200 --micro_train_batch_size 16 --learning_rate 1e-3 --max_len 64 --logging_steps 50 "
        f"--seed {SEED}"))
    assert "iteration 0: resuming with the samples" in result.stdout
    assert "for a high-reward answer with prompts like '" in result.stdout
    assert "<rm_score>: 1.0'" in result.stdout
    records = load_records(os.path.join(out, "iter_0", "csft.jsonl"))  # sft.py trained on it as it stands
    cut = sum(map(sum, (row["truncated"] for row in load_records(os.path.join(out, "iter_0", "generations.jsonl")))))
    assert len(records) == 8000 - cut and cut < 4000  # every whole response, each with its reward
    assert all(r["prompt"].endswith(f"<rm_score>: {r['reward']:.1f}") for r in records)
    assert metrics(out)[0]["csft/high_reward"] == 1.0

    rows = load_records(task["prompts_eval"])
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    trained = os.path.join(out, "iter_0", "model")
    high = greedy_scores(trained, [conditioned_prompt(p, 1.0, TEMPLATE, 1) for p in prompts], labels)
    low = greedy_scores(trained, [conditioned_prompt(p, 0.0, TEMPLATE, 1) for p in prompts], labels)
    print(f"conditional SFT greedy scores: high-reward prompt {high}, low-reward {low}")
    # In the data a reward of 1 never goes with the refusal and a reward of 0 often does (most of the larger sums'
    # samples), so the model should make the refusal less likely when asked for 1. That is checked on the refusal's
    # log-probability: greedy decoding turns it into a threshold effect, and whether the greedy answer flips varied
    # from 0.12 to 0.52 of the prompts over seeds 0-2 (200 steps at lr 1e-3 on its own samples fits the conditioning
    # only partly), while the log-probability moved the same way on every prompt of seeds 0-3, by 0.74-2.07 nats
    # on average.
    asked_high = refusal_logprobs(trained, [conditioned_prompt(p, 1.0, TEMPLATE, 1) for p in prompts])
    asked_low = refusal_logprobs(trained, [conditioned_prompt(p, 0.0, TEMPLATE, 1) for p in prompts])
    print(f"conditional SFT refusal log-prob: asked for 1 {asked_high.mean():.2f}, asked for 0 {asked_low.mean():.2f}")
    expect("csft: share of prompts where asking for reward 1 makes the refusal less likely",
           (asked_high < asked_low).float().mean().item(), ">=", 0.75)
    expect("csft: refusal log-prob asked for reward 0 - asked for 1, nats", (asked_low - asked_high).mean().item(),
           ">=", 0.35)


@pytest.mark.slow
def test_iterative_dpo_with_a_reward_model_resumes_in_the_iteration_it_was_stopped_in(best_of_n_run, sft_model,
                                                                                      task, tmp_path):
    rm = write_reward_model(sft_model, str(tmp_path / "rm"), reward_mean=0.1, reward_std=0.5)  # untrained
    out = str(tmp_path / "dpo")
    os.makedirs(os.path.join(out, "iter_0"))
    with open(os.path.join(best_of_n_run[0], "iter_0", "generations.jsonl")) as f:
        first_200 = f.readlines()[:200]
    with open(os.path.join(out, "iter_0", "generations.jsonl"), "w") as f:
        f.writelines(first_200)
    args = rs_args(sft_model, task, out, "--max_samples", "300", "--prompts_per_iteration", "200", "--mode",
                   "dpo_pairs", "--iterations", "2",
                   "--reward_pretrain", rm, "--reward_weights", "0.1", "1.0", "--reward_batch_size", "256",
                   "--train_args", "--max_steps 2 --train_batch_size 8 --micro_train_batch_size 4 --max_len 64")
    proc = run_script("rejection_sampling.py", args, background=True)
    generated = os.path.join(out, "iter_1", "generations.jsonl")
    deadline = time.time() + 400
    while not os.path.exists(generated) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped:\n" + proc.stdout.read()[-3000:]
    os.kill(proc.pid, signal.SIGTERM)  # a scheduler's stop, to the script this test started
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert errors == [f"error: interrupted; 1 finished iteration(s) in {out} are kept. Rerun the same command to "
                      f"resume."], output[-3000:]
    state = json.load(open(os.path.join(out, "state.json")))
    assert state["finished_iterations"] == 1 and os.path.exists(os.path.join(out, "iter_0", "model", "config.json"))

    result = run_script("rejection_sampling.py", args)
    assert "iteration 1: resuming with the samples" in result.stdout and "iteration 0" not in result.stdout
    assert f"dpo.py --pretrain {out}/iter_0/model --dataset {out}/iter_1/dpo_pairs.jsonl" in result.stdout
    assert json.load(open(os.path.join(out, "state.json")))["finished_iterations"] == 2
    prompts = [row["prompt"] for row in load_records(task["prompts_train"])[:300]]
    sampled = [[row["prompt"] for row in load_records(os.path.join(out, f"iter_{k}", "generations.jsonl"))]
               for k in (0, 1)]
    assert sampled == [prompts[:200], prompts[200:] + prompts[:100]]  # each round its own slice, wrapping around
    for k in (0, 1):
        pairs = load_records(os.path.join(out, f"iter_{k}", "dpo_pairs.jsonl"))  # dpo.py trained on them as they stand
        assert pairs and all(p["chosen_reward"] > p["rejected_reward"] and p["chosen"] != p["rejected"] for p in pairs)
        assert os.path.exists(os.path.join(out, f"iter_{k}", "model", "config.json"))
    # each reward is 0.1 x the reward model's normalised score + the rule reward
    scored = load_records(os.path.join(out, "iter_0", "scored.jsonl"))[:5]
    reward_model, tokenizer = load_reward_model(rm)
    for row in scored:
        learned = reward_model_scores(reward_model, tokenizer, [row["prompt"]] * 8, row["responses"], True)
        rule = reward_fn([row["prompt"]] * 8, row["responses"], [row["label"]] * 8)
        assert row["rewards"] == pytest.approx([0.1 * s + r for s, r in zip(learned, rule)], abs=1e-4)
    log = metrics(out)
    assert [m["step"] for m in log] == [1, 2] and log[1]["time/generate_seconds"] == 0  # no second sampling
