"""Shared test fixtures: the tiny model and synthetic task, built once per session, and a script runner."""

import os
import signal
import subprocess
import sys

import pytest

from common.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Offline and quiet, on any machine: no hub, no wandb account, no Ray token, vLLM inside the calling process.
os.environ.update(
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    WANDB_MODE="offline",
    RAY_AUTH_MODE="disabled",
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from common.tiny_model import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_model")), seed=0)


@pytest.fixture(scope="session")
def task(tmp_path_factory) -> dict:
    from common.synthetic_task import write_task

    return write_task(str(tmp_path_factory.mktemp("task")), seed=0)


@pytest.fixture(scope="session")
def sft_model(tiny_model, task, tmp_path_factory) -> str:
    """The tiny model after a short 2-rank ZeRO-3 SFT on the task: it answers some held-out problems, far from all.

    Shared by every test that needs a policy to start from; test_sft.py checks how it learned.
    """
    out = str(tmp_path_factory.mktemp("sft_model"))
    run_script("sft.py", ["--pretrain", tiny_model, "--dataset", task["sft_train"], "--apply_chat_template",
                          "--max_len", "64", "--max_steps", "600", "--train_batch_size", "32",
                          "--micro_train_batch_size", "16", "--learning_rate", "2e-3", "--warmup_ratio", "0.05",
                          "--zero_stage", "3", "--eval_dataset", task["sft_eval"], "--eval_steps", "200",
                          "--logging_steps", "10", "--output_dir", out], nprocs=2)
    return out


def run_script(script: str, args: list[str], nprocs: int = 1, timeout: int = 600, check: bool = True,
               background: bool = False):
    """Run a top-level script as a user would: `python script.py` (1 rank) or `deepspeed --num_gpus N script.py`."""
    if nprocs == 1:
        cmd = [sys.executable, os.path.join(ROOT, script), *args]
    else:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
               "--master_port", str(free_port()), os.path.join(ROOT, script), *args]
    if background:  # own process group, so a test can SIGKILL the launcher and every rank at once
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def kill_group(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
