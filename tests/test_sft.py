"""sft.py end to end on the real stack: 2-rank ZeRO-3 learning, transformers/vLLM loading, SIGKILL resume, bad input."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, expect, kill_group, metrics, run_script

from common.task_eval import greedy_responses, task_scores


def sft_args(model, task, out, *extra):
    return ["--pretrain", model, "--dataset", task["sft_train"], "--apply_chat_template", "--output_dir", out,
            "--max_len", "64", *extra]


@pytest.mark.slow
@pytest.mark.learning
def test_two_rank_zero3_sft_learns_and_saves_a_model_transformers_and_vllm_agree_on(tiny_model, sft_model, task):
    """sft_model (conftest.py) is 600 steps of `deepspeed --num_gpus 2 sft.py --zero_stage 3` on the task's noisy
    demonstrations: it should answer the smaller sums, mostly right, and refuse most of the larger ones, as the
    demonstrations do (about half the held-out problems have a larger sum)."""
    out = sft_model
    log = metrics(out)
    train_losses = [m["train/loss"] for m in log if "train/loss" in m]
    expect("sft: last train loss / first", train_losses[-1] / train_losses[0], "<=", 0.5)
    eval_losses = [m["eval/loss"] for m in log if "eval/loss" in m]
    assert len(eval_losses) >= 3 and eval_losses[-1] < eval_losses[0]

    base, trained = (task_scores(m, task["prompts_eval"]) for m in (tiny_model, out))
    assert base["accuracy"] == 0.0
    expect("sft: held-out accuracy", trained["accuracy"], ">=", 0.07)  # chance is ~1%
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
