"""sft.py end to end on the real stack: 2-rank ZeRO-3 learning, transformers/vLLM loading, SIGKILL resume, bad input."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, expect, kill_group, metrics, run_script, training_problem_scores
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import data
from common.modeling import next_token_logprobs
from common.task_eval import greedy_responses


def sft_args(model, task, out, *extra):
    return ["--pretrain", model, "--dataset", task["sft_train"], "--apply_chat_template", "--output_dir", out,
            "--max_len", "64", *extra]


@pytest.mark.slow
@pytest.mark.learning
def test_two_rank_zero3_sft_learns_and_saves_a_model_transformers_and_vllm_agree_on(tiny_model, sft_model, task):
    """sft_model (conftest.py) is 600 steps of `deepspeed --num_gpus 2 sft.py --zero_stage 3` on the task's noisy
    demonstrations: it should answer the smaller sums, mostly right, and refuse most of the larger ones, as the
    demonstrations do (about half the problems have a larger sum)."""
    out = sft_model
    log = metrics(out)
    train_losses = [m["train/loss"] for m in log if "train/loss" in m]
    expect("sft: last train loss / first", train_losses[-1] / train_losses[0], "<=", 0.5)
    # Evaluated every 200 steps, far below a random model's ~6 nats. Not required to fall: where a seed memorises the
    # training pairs instead of learning to add, the held-out loss rises (seed 1: 0.44, 0.60, 0.91).
    eval_losses = [m["eval/loss"] for m in log if "eval/loss" in m]
    assert len(eval_losses) >= 3 and max(eval_losses) < 2, eval_losses

    base, trained = (training_problem_scores(m, task) for m in (tiny_model, out))
    assert base["accuracy"] == 0.0
    expect("sft: accuracy on training problems", trained["accuracy"], ">=", 0.25)  # chance is ~3%
    expect("sft: share answered (at least)", trained["answered"], ">=", 0.25)
    expect("sft: share answered (at most)", trained["answered"], "<=", 0.75)

    prompts = [json.loads(line)["prompt"] for line in open(task["prompts_eval"])][:48]
    hf = greedy_responses(out, prompts)
    cmd = [sys.executable, "-m", "common.task_eval", "--model", out, "--prompts", task["prompts_eval"],
           "--limit", "48", "--engine", "vllm", "--show_responses"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    vllm = json.loads(result.stdout.strip().splitlines()[-1])["responses"]
    assert vllm == hf


@pytest.mark.slow
@pytest.mark.learning
def test_two_rank_zero3_sft_with_lora_learns_and_saves_the_merged_model_and_its_adapter(sft_model, task, tmp_path):
    """LoRA SFT of the SFT model on the right answers alone (the preference pairs' chosen side), ZeRO-3 on 2 ranks:
    it stops refusing and answers more sums right. The saved folder is the merged model, which plain transformers
    loads and which scores the eval set exactly as the run did, and beside it the adapter, which gives the same
    model on top of the starting one."""
    out = str(tmp_path / "sft_lora")
    run_script("sft.py", ["--pretrain", sft_model, "--dataset", task["pref_train"], "--eval_dataset",
                          task["pref_eval"], "--output_key", "chosen", "--apply_chat_template", "--max_len", "64",
                          "--max_steps", "60", "--train_batch_size", "32", "--micro_train_batch_size", "16",
                          "--learning_rate", "2e-3", "--zero_stage", "3", "--lora_rank", "16", "--lora_alpha", "32",
                          "--output_dir", out], nprocs=2)
    before, after = (training_problem_scores(m, task) for m in (sft_model, out))
    expect("sft lora: share answered", after["answered"], ">=", 0.9)
    expect("sft lora: accuracy gain over SFT", after["accuracy"] - before["accuracy"], ">=", 0.2)

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    start = AutoModelForCausalLM.from_pretrained(sft_model).eval()
    assert torch.equal(merged.model.embed_tokens.weight, start.model.embed_tokens.weight)  # frozen
    # The eval loss the run computed in memory after its last step, recomputed from the saved model alone.
    tokenizer = AutoTokenizer.from_pretrained(out)
    samples = data.build_sft_samples(data.load_records(task["pref_eval"]), tokenizer, task["pref_eval"], "prompt",
                                     "chosen", 64, apply_chat_template=True, log=lambda msg: None)
    batch = data.pad_collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = next_token_logprobs(merged, batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"][:, 1:].float()
    recomputed = (-(logprobs * mask).sum() / mask.sum()).item()
    assert abs(recomputed - metrics(out)[-1]["eval/loss"]) < 1e-4, (recomputed, metrics(out)[-1])

    from peft import PeftModel

    adapted = PeftModel.from_pretrained(start, os.path.join(out, "adapter")).eval()
    ids = batch["input_ids"][:8]
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def logged_losses(out: str) -> dict[int, float]:
    """train/loss by step from metrics.jsonl; a line the run is still writing is left for the next read."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return {m["step"]: m["train/loss"] for m in rows if "train/loss" in m}


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_losses(tiny_model, task, tmp_path):
    """Every rank SIGKILLed (no handler runs) a step after the checkpoint of step 4: the rerun of the same command
    resumes there, trains the steps the killed run had logged to the same losses, and keeps the newest two
    checkpoints."""
    out = str(tmp_path / "run")
    args = sft_args(tiny_model, task, out, "--zero_stage", "3", "--max_steps", "12", "--save_steps", "4",
                    "--train_batch_size", "16", "--micro_train_batch_size", "4", "--learning_rate", "2e-3",
                    "--logging_steps", "1")
    proc = run_script("sft.py", args, nprocs=2, background=True)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and max(logged_losses(out), default=0) <= 4:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    kill_group(proc)
    killed_at = int(open(os.path.join(out, "checkpoints", "latest")).read().split("_")[1])
    before = logged_losses(out)
    assert killed_at < max(before) < 12 and not os.path.exists(os.path.join(out, "config.json")), (killed_at, before)

    result = run_script("sft.py", args, nprocs=2)
    assert f"resumed from {os.path.join(out, 'checkpoints')} at step {killed_at}" in result.stdout
    after = logged_losses(out)
    assert sorted(after) == list(range(1, 13))  # each step once, the killed run's unfinished ones trained again
    for step in range(killed_at + 1, max(before) + 1):
        assert after[step] == pytest.approx(before[step], rel=1e-4), (step, before, after)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [".partial", "latest", "settings.json", "step_12",
                                                                    "step_8"]


@pytest.mark.slow
def test_bad_input_gives_one_clear_sentence_and_writes_nothing(tiny_model, task, tmp_path):
    """One case as a user meets it, `python sft.py`: test_bad_inputs.py runs the whole matrix in-process."""
    out = str(tmp_path / "out")
    args = sft_args(tiny_model, task, out, "--train_batch_size", "10", "--micro_train_batch_size", "4")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == ["error: --train_batch_size 10 must be a multiple of --micro_train_batch_size 4 x 1 ranks = 4."]
    assert not os.path.exists(out)


@pytest.mark.slow
def test_a_step_trains_the_same_whatever_its_micro_batches_and_ranks(tiny_model, task, tmp_path):
    """The loss was each micro-batch's token mean, averaged: a short response weighed as much as a long one when the
    two fell in different micro-batches, so --micro_train_batch_size and the number of ranks changed the objective.
    One batch of 8 as 1 micro-batch, as 4 of 2, and as 2 ranks x 2 of 2: the same losses, before and after a step."""
    losses = {}
    for name, micro, ranks in (("whole", 8, 1), ("split", 2, 1), ("ranks", 2, 2)):
        out = str(tmp_path / name)
        run_script("sft.py", sft_args(tiny_model, task, out, "--zero_stage", "0" if ranks == 1 else "3",
                                      "--max_steps", "3", "--train_batch_size", "8", "--micro_train_batch_size",
                                      str(micro), "--learning_rate", "1e-2", "--logging_steps", "1"), nprocs=ranks)
        losses[name] = logged_losses(out)
    assert sorted(losses["whole"]) == [1, 2, 3] and losses["whole"][3] < losses["whole"][1] - 0.1, losses  # it moved
    for name in ("split", "ranks"):
        for step, loss in losses["whole"].items():
            assert losses[name][step] == pytest.approx(loss, rel=2e-3), (name, losses)
