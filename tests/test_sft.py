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


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_result(tiny_model, task, tmp_path):
    common = ["--zero_stage", "3", "--max_steps", "12", "--save_steps", "4", "--train_batch_size", "16",
              "--micro_train_batch_size", "4", "--learning_rate", "2e-3"]
    reference = str(tmp_path / "reference")
    run_script("sft.py", sft_args(tiny_model, task, reference, *common), nprocs=2)

    out = str(tmp_path / "resumed")
    proc = run_script("sft.py", sft_args(tiny_model, task, out, *common), nprocs=2, background=True)
    latest = os.path.join(out, "checkpoints", "latest")
    deadline = time.time() + 300
    while not os.path.exists(latest) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
    kill_group(proc)
    killed_at = int(open(latest).read().split("_")[1])
    assert killed_at < 12 and not os.path.exists(os.path.join(out, "config.json"))

    result = run_script("sft.py", sft_args(tiny_model, task, out, *common), nprocs=2)
    assert f"resumed from {os.path.join(out, 'checkpoints')} at step {killed_at}" in result.stdout
    final, expected = metrics(out)[-1], metrics(reference)[-1]
    assert final["step"] == expected["step"] == 12
    assert final["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-4)
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
