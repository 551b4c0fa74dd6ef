"""The real-model tier (`make test-real`, or `pytest -m real` once requirements-real.txt is installed): the scripts a
few steps on SmolLM2-135M-Instruct (common/real_model.py), a chat model no one here built, with what the tiny
fixtures lack: a 49,152-token vocabulary, 30 layers, 9 query / 3 key-value heads, tied embeddings, and a chat
template that adds a default system prompt. Left out of `make test` (pytest.ini deselects `real`): about half an
hour on 2 quiet cores (several times that when other runs share the cores), and a first run builds the model (~30 s).

Most tests check that the code holds on a real model: a few steps on tiny data. The last ones are the sanity runs: a
method of each family (the demo's GRPO, 3 minutes on 2 quiet cores; RLOO; iterative DPO) must raise the share of
right answers far above the base model's, with thresholds far under what one or two seeds reached
(docs/real_model.md).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, metrics, run_script

pytestmark = [pytest.mark.real, pytest.mark.slow]

SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
REWARD_FN = os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn"
RIGHT_ANSWER = os.path.join(ROOT, "launch", "right_answer_reward.py") + ":reward_fn"  # make demo-real's reward
# vllm/logprob_diff, the mean |vLLM log-prob - trainer log-prob| over sampled tokens: 8.9e-6 to 9.7e-6 at every step
# of two runs of the GRPO test below (fp32, CPU; issue 40 saw ~9e-6, flat over 8 steps), while its 3 steps moved the
# policy's log-probs by 5.9e-2 a token: a weight the sync left stale shows far above this margin.
LOGPROB_DIFF_MARGIN = 5e-5


@pytest.fixture(scope="module")
def real_model() -> str:
    from common.real_model import real_model_dir

    try:
        return real_model_dir()
    except SystemExit as e:  # the optional packages are missing: say how to get them
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


def test_what_every_model_reads_holds_the_chat_templates_system_prompt(real_model, tokenizer, task):
    """The SFT and preference samples, the prompts the policy continues and the texts the reward model scores are
    rendered by the model's own template, default system prompt included; a reward is read at the end-of-turn token
    the template closes the assistant's turn with (rm.py trains on what reward_model_input_ids gives)."""
    from common import data

    sft_rows = data.load_records(task["sft_train"])[:4]
    pref_rows = data.load_records(task["pref_train"])[:4]
    sft = data.build_sft_samples(sft_rows, tokenizer, task["sft_train"], "prompt", "response", 128,
                                 apply_chat_template=True, log=lambda _: None)
    pairs = data.build_preference_samples(pref_rows, tokenizer, task["pref_train"], "prompt", "chosen", "rejected",
                                          128, apply_chat_template=True, log=lambda _: None)
    prompt = data.render_prompt(tokenizer, pref_rows[0]["prompt"], True, None)
    scored = data.reward_model_input_ids(tokenizer, pref_rows[0]["prompt"], pref_rows[0]["chosen"], 128, True)
    for text in [tokenizer.decode(s["input_ids"]) for s in sft] + [
            tokenizer.decode(p[side]["input_ids"]) for p in pairs for side in ("chosen", "rejected")] + [
            prompt, tokenizer.decode(scored)]:
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"), text
    trained = [t for s in sft for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
    assert SYSTEM_PROMPT not in tokenizer.decode(trained)  # the loss is on the responses only
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    assert scored[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.decode(scored[-3:])


def train(script: str, real_model: str, dataset: str, out: str, *extra: str) -> list[dict]:
    """Three steps of `script` on the real model with its chat template; the run's metrics. (check=False: a trainer
    starts no vLLM engine, and run_script's check for engines' leftover files would see other runs' on a shared
    machine.)"""
    result = run_script(f"{script}.py", ["--pretrain", real_model, "--dataset", dataset, "--apply_chat_template",
                                         "--max_len", "96", "--train_batch_size", "4", "--micro_train_batch_size", "4",
                                         "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-5",
                                         "--output_dir", out, *extra], check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return metrics(out)


@pytest.mark.parametrize("script", ["sft", "rm", "dpo", "kto"])
def test_a_trainer_runs_on_the_real_model_and_saves_a_model_plain_transformers_loads(script, real_model, tokenizer,
                                                                                     task, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out, dataset = str(tmp_path / script), tmp_path / "data.jsonl"
    source = {"sft": "sft_train", "rm": "pref_train", "dpo": "pref_train", "kto": "kto_train"}[script]
    with open(task[source]) as f:  # 32 rows: rm.py's reward statistics score every training pair (up to 1000)
        dataset.write_text("".join(f.readlines()[:32]))
    rows = train(script, real_model, str(dataset), out)
    losses = [m["train/loss"] for m in rows if "train/loss" in m]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), losses

    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert SYSTEM_PROMPT in saved_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "5"}], tokenize=False)
    ids = saved_tokenizer(text.rstrip("\n"), return_tensors="pt").input_ids
    if script == "rm":
        model = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
        assert model.config.num_labels == 1
        with torch.no_grad():
            score = model(ids).logits
        assert score.shape == (1, 1) and torch.isfinite(score).all(), (text, score)
        return
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    start = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    with torch.no_grad():
        trained, before = model(ids).logits, start(ids).logits
    assert torch.isfinite(trained).all() and not torch.equal(trained, before)  # trained, and saved as trained


BREVITY = """
def reward_fn(prompts, responses, labels):
    return [-len(response.split()) / 16 for response in responses]
"""


def mean_token_logprob_change(model_a: str, model_b: str, text: str) -> float:
    """Mean |log p_a - log p_b| of each token of `text` under two saved models (plain transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_a)(text, return_tensors="pt").input_ids
    logprobs = []
    for path in (model_a, model_b):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]))
    return (logprobs[0] - logprobs[1]).abs().mean().item()


def test_grpo_on_the_real_model_keeps_vllm_on_the_trainers_log_probs(real_model, tokenizer, task, tmp_path):
    """After each weight sync vLLM samples from the trainer's weights: vllm/logprob_diff stays at the float level
    measured on this model (LOGPROB_DIFF_MARGIN); step 1 compares the weights both loaded from disk, the later steps
    the synced ones (30 layers, tied embeddings). A reward for brevity varies within every group, so each step moves
    the policy, by far more than the margin: a sync that left any weight stale would show."""
    out, reward = str(tmp_path / "grpo"), tmp_path / "brevity.py"
    reward.write_text(BREVITY)
    run_script("ppo_ray.py", ["--pretrain", real_model, "--prompt_data", task["prompts_train"], "--apply_chat_template",
                              "--output_dir", out, "--prompt_max_len", "64", "--generate_max_len", "16",
                              "--reward_fn", f"{reward}:reward_fn", "--advantage_estimator", "grpo",
                              "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
                              "--micro_train_batch_size", "8", "--actor_learning_rate", "1e-5", "--init_kl_coef",
                              "0.001", "--max_steps", "3"])
    rows = [m for m in metrics(out) if "vllm/logprob_diff" in m]
    diffs = [m["vllm/logprob_diff"] for m in rows]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+13?"},
                                          {"role": "assistant", "content": "12 + 13 = 25."}], tokenize=False)
    moved = mean_token_logprob_change(real_model, out, text)  # the saved policy loads with plain transformers
    print(f"vllm/logprob_diff by step: {diffs}; the policy moved by {moved:.2e} per token over "
          f"{len(diffs)} steps; objective/kl by step: {[m.get('objective/kl') for m in rows]}")
    assert len(diffs) == 3
    assert max(diffs) < LOGPROB_DIFF_MARGIN, f"vLLM drifts from the trainer after the weight syncs: {diffs}"
    assert moved > 10 * LOGPROB_DIFF_MARGIN, f"the policy barely moved ({moved:.2e}): the test checks no sync"


def test_rejection_sampling_on_the_real_model_keeps_each_prompts_best_whole_sample(real_model, tokenizer, task,
                                                                                     tmp_path):
    """Best-of-4 with the demo's reward (right answers), then sft.py on the best: the rewards in the scored file are
    the rule's own on the decoded responses (no end-of-turn marker left in the text), each kept response is its
    prompt's best sample the engine finished, and the trained model loads with plain transformers, changed."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.data import load_records
    from launch.right_answer_reward import reward_fn

    out = str(tmp_path / "rs")
    run_script("rejection_sampling.py", [
        "--pretrain", real_model, "--dataset", task["prompts_train"], "--max_samples", "16", "--apply_chat_template",
        "--n_samples_per_prompt", "4", "--generate_max_len", "48", "--max_model_len", "256", "--enforce_eager",
        "--reward_fn", RIGHT_ANSWER, "--iterations", "1", "--output_dir", out, "--train_args",
        "--max_steps 2 --train_batch_size 4 --micro_train_batch_size 4 --learning_rate 1e-5 --max_len 128"])
    scored = load_records(os.path.join(out, "iter_0", "scored.jsonl"))
    kept = {r["prompt"]: r for r in load_records(os.path.join(out, "iter_0", "best_of_n.jsonl"))}
    assert len(scored) == 16 and len(kept) >= 4, (len(scored), len(kept))
    for row in scored:
        assert all("<|im_end|>" not in text and "<|im_start|>" not in text for text in row["responses"]), row
        assert row["rewards"] == reward_fn([row["prompt"]] * 4, row["responses"], [row["label"]] * 4), row
        whole = [r for r, cut in zip(row["rewards"], row["truncated"]) if not cut]
        if row["prompt"] in kept:
            assert kept[row["prompt"]]["reward"] == max(whole), (row, kept[row["prompt"]])
            assert kept[row["prompt"]]["response"] in row["responses"]
        else:
            assert not whole, row  # a prompt is dropped only when every sample was cut
    log = metrics(out)
    assert log[0]["rewards/best_mean"] >= log[0]["rewards/mean"], log
    assert json.load(open(os.path.join(out, "state.json")))["finished_iterations"] == 1
    ids = tokenizer("What is 2+3?", return_tensors="pt").input_ids
    with torch.no_grad():
        trained, before = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
                           for path in (os.path.join(out, "iter_0", "model"), real_model))
    assert torch.isfinite(trained).all() and not torch.equal(trained, before)


def test_ppo_with_a_reward_model_and_a_critic_on_the_real_model(real_model, tokenizer, task, tmp_path):
    """PPO as InstructGPT ran it, on the real model: a reward model rm.py trained (3 steps), a critic started from
    it, GAE, a KL penalty to the reference. Every step's losses and scores are finite, vLLM stays on the trainer's
    log-probs after each sync, the KL to the reference is 0 at the first step (the policy is the reference) and not
    after the first update, and the saved actor loads with plain transformers."""
    import math

    rm, pairs = str(tmp_path / "rm"), tmp_path / "pairs.jsonl"
    with open(task["pref_train"]) as f:
        pairs.write_text("".join(f.readlines()[:32]))
    train("rm", real_model, str(pairs), rm)
    out = str(tmp_path / "ppo")
    run_script("ppo_ray.py", ["--pretrain", real_model, "--reward_pretrain", rm, "--critic_pretrain", rm,
                              "--advantage_estimator", "gae", "--prompt_data", task["prompts_train"],
                              "--apply_chat_template", "--output_dir", out, "--prompt_max_len", "64",
                              "--generate_max_len", "16", "--n_samples_per_prompt", "1", "--rollout_batch_size", "8",
                              "--train_batch_size", "8", "--micro_train_batch_size", "4", "--actor_learning_rate",
                              "1e-5", "--critic_learning_rate", "1e-5", "--init_kl_coef", "0.01", "--max_steps", "3"])
    rows = [m for m in metrics(out) if "objective/scores" in m]
    print("by step:", [{k: round(m[k], 6) for k in ("objective/scores", "objective/kl", "loss/policy_avg",
                                                    "loss/value_avg", "vllm/logprob_diff")} for m in rows])
    assert len(rows) == 3
    for m in rows:
        for key in ("objective/scores", "objective/kl", "objective/returns", "loss/policy_avg", "loss/value_avg"):
            assert math.isfinite(m[key]), (key, m)
    assert max(m["vllm/logprob_diff"] for m in rows) < LOGPROB_DIFF_MARGIN, rows
    kls = [m["objective/kl"] for m in rows]
    assert abs(kls[0]) < 1e-6 and abs(kls[-1]) > 1e-5, kls
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+13?"},
                                          {"role": "assistant", "content": "25"}], tokenize=False)
    moved = mean_token_logprob_change(real_model, out, text)  # the saved actor loads with plain transformers
    assert moved > 10 * LOGPROB_DIFF_MARGIN, f"the saved actor is the starting model ({moved:.2e} a token)"


# ------------------------------------------------------------------------------------------- the sanity runs
# prime-rl's sanity run for an RL library, on the real model: the training questions the base model answers right in
# 20-80% of its samples, a reward for correctness alone, and a short run of each family of method. Thresholds: under
# the lowest of the seeds measured (one to three, docs/real_model.md) by a wide margin, far above what the base model
# scores on the same problems.
SANITY_STEPS = 16
# The demo, seeds 0, 1, 2 and 3: sampled answers right over the last 6 of 24 steps 0.96, 0.92, 0.91 and 0.96 (step 1:
# 0.22, 0.16, 0.31, 0.31); held-out greedy answers right 46% -> 79%, 88%, 84% and 100%. The gain asked is the issue's
# target, under half the lowest seen.
DEMO_LAST_STEPS_ACCURACY = 0.75
DEMO_HELD_OUT_GAIN = 0.15
# RLOO, seeds 42 (ppo_ray.py's default), 1, 2, 3, with the overlong penalty of the test: sampled answers right 0.19,
# 0.36, 0.44, 0.33 at steps 1-2, 0.98, 0.92, 0.91, 0.84 over the last 4 of 16 steps. Without the penalty and with a
# 32-token limit, seed 2 stayed at 0.54: 60-94% of its answers ran into the limit until step 15.
RLOO_LAST_STEPS_ACCURACY = 0.70
# Iterative DPO, the band's 75 questions, sampled answers right before and after each of three rounds of DPO on the
# model's own pairs (learning rate 3e-5, 2 epochs a round; a rejected answer may be one the 48-token limit cut):
# seed 0 0.37, 0.69, 0.75, 0.89; seed 1 0.35, 0.34, 0.88, 0.84; seed 2 0.39, 0.56, 0.84, 1.00; seed 3 0.39, 0.90,
# 0.81, 0.95 (the last rounds of seeds 2 and 3 left 0 and 7 pairs, less than a batch: logged, not trained). Before cut
# answers could be rejected, seed 1 went 0.35, 0.50, 0.65, 0.43.
ITERATIVE_DPO_LAST_ACCURACY = 0.75


@pytest.fixture(scope="module")
def band(real_model, tmp_path_factory) -> dict:
    """The sanity run's task: single-digit sums (the demo's), and the training questions the base model answers right
    in 20-80% of 8 samples at temperature 0.7 (common/solve_rate.py); {"train": file, "base_accuracy": its mean}."""
    folder = tmp_path_factory.mktemp("band")
    subprocess.run([sys.executable, "-m", "common.synthetic_task", "--out", str(folder), "--max_operand", "10"],
                   cwd=ROOT, check=True, capture_output=True)
    band_file = folder / "band.jsonl"
    subprocess.run([sys.executable, "-m", "common.solve_rate", "--model", real_model, "--prompts",
                    str(folder / "prompts_train.jsonl"), "--reward_fn", RIGHT_ANSWER, "--out", str(band_file),
                    "--limit", "96"],
                   cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in band_file.read_text().splitlines()]
    assert len(rows) >= 32, rows  # enough problems for the runs below
    return {"train": str(band_file), "base_accuracy": sum(r["solve_rate"] for r in rows) / len(rows)}


def sampled_accuracy(out: str) -> list[float]:
    """The share of a ppo_ray.py run's sampled answers that were right, by step: right_answer's reward before any
    length shaping (`rewards/rule`; `objective/scores` adds --overlong_buffer_len's penalty)."""
    return [m["rewards/rule"] for m in metrics(out) if "rewards/rule" in m]


def test_make_demo_real_raises_right_answers_on_training_and_held_out_questions(tmp_path):
    """make demo-real, whole: GRPO with a reward for right answers alone drives the share of sampled answers right on
    the training questions far above the base model's, and the greedy answers to held-out questions (operand pairs
    GRPO never saw) gain DEMO_HELD_OUT_GAIN; the demo writes its summary and curve."""
    out = tmp_path / "demo_real"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "demo_real.py"), "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    print({k: results[k] for k in ("seed", "first", "last", "accuracy_before", "accuracy_after", "fixed", "broken")})
    assert results["first"] < DEMO_LAST_STEPS_ACCURACY - 0.3, results  # else the test shows nothing learned
    assert results["last"] >= DEMO_LAST_STEPS_ACCURACY, results
    assert results["accuracy_after"] >= results["accuracy_before"] + DEMO_HELD_OUT_GAIN, results
    assert (out / "reward_curve.png").stat().st_size > 0
    assert "| held-out questions answered right (greedy) |" in (out / "summary.md").read_text()


def test_rloo_on_the_band_raises_the_share_of_right_answers(real_model, band, tmp_path):
    """The sanity run with RLOO's leave-one-out baseline instead of GRPO's group mean and std, and DAPO's soft
    overlong penalty over the 16 tokens before a 48-token limit: an answer of 32 tokens or fewer is paid for being
    right alone, a longer one loses up to 1, so a right answer is never paid less than a wrong one (>= 0 against <= 0)
    and a seed whose answers run long learns to finish them (without it, seed 2 spent its 16 steps with 60-94% of its
    answers cut at 32 tokens, some paid for the number they were cut at)."""
    out = str(tmp_path / "rloo")
    run_script("ppo_ray.py", ["--pretrain", real_model, "--prompt_data", band["train"], "--apply_chat_template",
                              "--reward_fn", RIGHT_ANSWER, "--advantage_estimator", "rloo",
                              "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
                              "--micro_train_batch_size", "8", "--actor_learning_rate", "5e-5", "--temperature",
                              "0.7", "--init_kl_coef", "0", "--prompt_max_len", "64", "--generate_max_len", "48",
                              "--overlong_buffer_len", "16", "--max_steps", str(SANITY_STEPS), "--output_dir", out])
    accuracy = sampled_accuracy(out)
    print(f"base {band['base_accuracy']:.2f}; sampled accuracy by step {[round(a, 2) for a in accuracy]}")
    last = sum(accuracy[-4:]) / 4
    assert band["base_accuracy"] < RLOO_LAST_STEPS_ACCURACY - 0.2, band  # the band holds what the base model misses
    assert last >= RLOO_LAST_STEPS_ACCURACY, accuracy


def test_iterative_dpo_on_the_band_raises_the_share_of_right_answers(real_model, band, tmp_path):
    """The sanity run with DPO on pairs the model sampled itself (rejection_sampling.py --mode dpo_pairs): each round
    samples 8 answers a band question, pairs a right one with a wrong one, trains dpo.py on the pairs and samples the
    next round from the model just trained; the fourth round's samples show what three rounds of DPO taught."""
    out = str(tmp_path / "dpo")
    run_script("rejection_sampling.py", [
        "--pretrain", real_model, "--dataset", band["train"], "--apply_chat_template", "--n_samples_per_prompt", "8",
        "--temperature", "0.7", "--generate_max_len", "48", "--max_model_len", "256", "--enforce_eager", "--seed", "0",
        "--reward_fn", RIGHT_ANSWER, "--mode", "dpo_pairs", "--iterations", "4", "--output_dir", out, "--train_args",
        "--train_batch_size 8 --micro_train_batch_size 8 --learning_rate 3e-5 --beta 0.1 --max_len 128 --max_epochs 2"])
    accuracy = [m["rewards/mean"] for m in metrics(out) if "rewards/mean" in m]
    print(f"base {band['base_accuracy']:.2f}; sampled accuracy by round {[round(a, 2) for a in accuracy]}")
    assert len(accuracy) == 4, accuracy
    assert accuracy[0] < ITERATIVE_DPO_LAST_ACCURACY - 0.2, accuracy  # the band holds what the base model misses
    assert accuracy[-1] >= ITERATIVE_DPO_LAST_ACCURACY, accuracy
