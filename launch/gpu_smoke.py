"""A few steps of every GPU path, for the first run on a CUDA machine: `make gpu-smoke`.

The CPU test suite proves the GPU paths by simulation (tests/test_placement.py, tests/test_gpu_paths.py); this is
the check on the real thing, a few minutes on a tiny model and the synthetic task:

    sft          deepspeed --num_gpus 1 sft.py       bf16, NCCL, flash attention when installed
    dpo          deepspeed --num_gpus 1 dpo.py       a frozen ZeRO-3 reference beside the policy
    qlora        ... dpo.py --lora_rank --load_in_4bit   QLoRA: a 4-bit base (bitsandbytes), adapters off as reference
    rm           deepspeed --num_gpus 1 rm.py        the reward model the critic stage scores with
    ppo          python ppo_ray.py                   actor + reference on GPU 0, the vLLM engine on GPU 1 (NCCL sync)
    ppo_all      python ppo_ray.py --colocate_all    everything on one GPU: vLLM's sleep mode, CUDA IPC sync
    ppo_tp2      ... --colocate_all, 2 actor ranks, one engine at tensor parallel 2: IPC to one vLLM worker, NCCL to
                 the other
    ppo_critic   ... --advantage_estimator gae --reward_pretrain: critic and reward-model workers beside the actor
    ppo_async    ... --async_rollouts               the engine on GPU 1 samples the next step while GPU 0 trains
    ppo_packing  ... --packing_samples              the trainers' varlen flash-attention path
    ppo_lora     ... --lora_rank 16                 adapters trained, merged into the engine at each sync

Each stage prints "ok" with its time, or its log's last lines and the command to rerun it. Stages that need 2 GPUs
(NEEDS_GPUS) are skipped on a machine with one, and ppo_packing where flash-attn is not installed, each saying so.

    python launch/gpu_smoke.py --out out/gpu_smoke
"""

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEEPSPEED_1 = [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "1"]  # what `deepspeed --num_gpus 1` runs


# Stages that place roles on separate GPUs; every other stage runs on one.
NEEDS_GPUS = {"ppo": 2, "ppo_tp2": 2, "ppo_async": 2}


def commands(out: str, gpus: int, flash_attn: bool = True) -> list[tuple[str, list[str]]]:
    """(stage, command) in order; stages needing more GPUs than `gpus`, or flash-attn where it is missing, are left
    out (skipped() says which and why)."""
    task = os.path.join(out, "task")
    model, sft, rm = os.path.join(out, "base"), os.path.join(out, "sft"), os.path.join(out, "rm")
    data = {name: os.path.join(task, name + ".jsonl") for name in ("sft_train", "pref_train", "prompts_train")}
    rule = ["--reward_fn", os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn",
            "--advantage_estimator", "grpo"]
    ppo = [PY, "ppo_ray.py", "--pretrain", sft, "--prompt_data", data["prompts_train"], "--apply_chat_template",
           "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
           "--micro_train_batch_size", "8", "--prompt_max_len", "64", "--generate_max_len", "8", "--max_steps", "2",
           "--vllm_gpu_memory_utilization", "0.3"]
    stages = [
        ("base", [PY, "-m", "common.tiny_model", "--out", model]),
        ("task", [PY, "-m", "common.synthetic_task", "--out", task]),
        ("sft", [*DEEPSPEED_1, "sft.py", "--pretrain", model, "--dataset", data["sft_train"], "--apply_chat_template",
                 "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_steps", "4",
                 "--output_dir", sft]),
        ("dpo", [*DEEPSPEED_1, "dpo.py", "--pretrain", sft, "--dataset", data["pref_train"], "--apply_chat_template",
                 "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_steps", "2",
                 "--output_dir", os.path.join(out, "dpo")]),
        ("qlora", [*DEEPSPEED_1, "dpo.py", "--pretrain", sft, "--dataset", data["pref_train"], "--apply_chat_template",
                   "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_steps", "2",
                   "--lora_rank", "16", "--load_in_4bit", "--zero_stage", "2", "--output_dir",
                   os.path.join(out, "qlora")]),
        ("rm", [*DEEPSPEED_1, "rm.py", "--pretrain", sft, "--dataset", data["pref_train"], "--apply_chat_template",
                "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_steps", "2",
                "--output_dir", rm]),
        ("ppo", [*ppo, *rule, "--colocate_actor_ref"]),
        ("ppo_all", [*ppo, *rule, "--colocate_all"]),
        ("ppo_tp2", [*ppo, *rule, "--colocate_all", "--actor_num_workers", "2", "--vllm_tensor_parallel_size", "2"]),
        ("ppo_critic", [*ppo, "--reward_pretrain", rm, "--advantage_estimator", "gae", "--colocate_all"]),
        ("ppo_async", [*ppo, *rule, "--async_rollouts", "--colocate_actor_ref"]),
        ("ppo_packing", [*ppo, *rule, "--packing_samples", "--colocate_all"]),
        ("ppo_lora", [*ppo, *rule, "--lora_rank", "16", "--colocate_all"]),
    ]
    return [(stage, cmd + (["--output_dir", os.path.join(out, stage)] if stage.startswith("ppo") else []))
            for stage, cmd in stages if NEEDS_GPUS.get(stage, 1) <= gpus and (flash_attn or stage != "ppo_packing")]


def skipped(gpus: int, flash_attn: bool) -> list[str]:
    """A sentence for each stage commands() leaves out on this machine."""
    lines = [f"{stage} skipped: it needs {needed} GPUs and this machine has {gpus}."
             for stage, needed in NEEDS_GPUS.items() if needed > gpus]
    if not flash_attn:
        lines.append("ppo_packing skipped: --packing_samples on a GPU needs flash-attn, which is not installed "
                     "(pip install flash-attn --no-build-isolation).")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu_smoke", help="output folder (emptied first)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: make gpu-smoke checks the CUDA paths and this machine has no CUDA GPU; on CPU run make demo.")
    gpus = torch.cuda.device_count()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    flash_attn = importlib.util.find_spec("flash_attn") is not None
    stages = commands(os.path.abspath(args.out), gpus, flash_attn)
    for line in skipped(gpus, flash_attn):
        print(line)
    failed = []
    for stage, cmd in stages:
        log = os.path.join(args.out, stage + ".log")
        start = time.time()
        with open(log, "w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        if code == 0:
            print(f"{stage:11} ok in {time.time() - start:.0f} s")
            continue
        with open(log) as f:
            tail = f.read().splitlines()[-25:]
        print(f"{stage:11} FAILED (exit {code}); the end of {log}:\n  " + "\n  ".join(tail)
              + f"\n  rerun: {shlex.join(cmd)}")
        failed.append(stage)
        if stage in ("base", "task", "sft"):  # every later stage starts from these
            break
    print("gpu-smoke: " + (f"{len(failed)} stage(s) failed: {', '.join(failed)}" if failed else "every stage ran"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
