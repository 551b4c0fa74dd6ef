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
    ppo_qlora    ... --lora_rank 16 --load_in_4bit   QLoRA PPO: dequantized layers and merged adapters at each sync
    ppo_moe      ... a tiny Mixtral (base_moe)      fused experts sent in the checkpoint's layout at each sync

A stage passes when its command exits with 0 and, for a PPO stage, when vLLM sampled from the trainer's weights after
every sync: `vllm/logprob_diff` (mean |vLLM's log-prob - the trainer's| over the sampled tokens, which ppo_ray.py logs
on-policy too) may be at most twice step 1's, where both sides loaded the same checkpoint from disk, plus SYNC_SLACK
(check_sync). A sync that loads nothing leaves the engines one update behind, and the smoke's learning
rate makes that update show (tests/test_ppo.py checks the check on CPU runs, stale engines included). ppo_async
samples from the policy one update old by design: its differences are printed, not checked (its sync is the ppo
stage's NCCL path, checked there). Then one table: each stage's
seconds, the GPUs' peak memory (nvidia-smi, polled) against the memory plan's busiest GPU (PPO stages,
common/memory_plan.py), and the log-prob differences. A failed stage prints its log's last lines and the command to
rerun it. Stages that need 2 GPUs (NEEDS_GPUS) are skipped on a machine with one, and ppo_packing where flash-attn
is not installed, each saying so.

    python launch/gpu_smoke.py --out out/gpu_smoke
"""

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEEPSPEED_1 = [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "1"]  # what `deepspeed --num_gpus 1` runs


# Stages that place roles on separate GPUs; every other stage runs on one.
NEEDS_GPUS = {"ppo": 2, "ppo_tp2": 2, "ppo_async": 2}
# How far past twice step 1's log-prob difference (the two implementations' rounding on one checkpoint) a step after a
# sync may go. On CPU in fp32 a right sync stays at ~1e-6, and engines one update behind (tests/test_ppo.py's async run,
# lr 3e-4) above 1e-3. Not yet measured on a GPU, where bf16 rounding sets step 1's value.
SYNC_SLACK = 1e-3
STALE_BY_DESIGN = {"ppo_async"}  # rollouts from step 2 on come from the policy one update old


def commands(out: str, gpus: int, flash_attn: bool = True) -> list[tuple[str, list[str]]]:
    """(stage, command) in order; stages needing more GPUs than `gpus`, or flash-attn where it is missing, are left
    out (skipped() says which and why)."""
    task = os.path.join(out, "task")
    model, sft, rm = os.path.join(out, "base"), os.path.join(out, "sft"), os.path.join(out, "rm")
    moe = os.path.join(out, "base_moe")
    data = {name: os.path.join(task, name + ".jsonl") for name in ("sft_train", "pref_train", "prompts_train")}
    rule = ["--reward_fn", os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn",
            "--advantage_estimator", "grpo"]
    # 3 steps, each update large enough (lr 1e-3) that engines left one update behind show in vllm/logprob_diff
    ppo = [PY, "ppo_ray.py", "--prompt_data", data["prompts_train"], "--apply_chat_template",
           "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
           "--micro_train_batch_size", "8", "--prompt_max_len", "64", "--generate_max_len", "8", "--max_steps", "3",
           "--actor_learning_rate", "1e-3", "--vllm_gpu_memory_utilization", "0.3"]
    moe_ppo = [*ppo, "--pretrain", moe]
    ppo = [*ppo, "--pretrain", sft]
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
        ("ppo_shared", [*ppo, *rule, "--share_prompts", "--colocate_all"]),  # sdpa with a mask, in bf16
        ("ppo_lora", [*ppo, *rule, "--lora_rank", "16", "--colocate_all"]),
        ("ppo_qlora", [*ppo, *rule, "--lora_rank", "16", "--load_in_4bit", "--colocate_all"]),
        ("base_moe", [PY, "-m", "common.tiny_model", "--out", moe, "--architecture", "mixtral"]),
        ("ppo_moe", [*moe_ppo, *rule, "--colocate_all"]),
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


def check_sync(stage: str, rows: list[dict]) -> str | None:
    """Why a PPO stage's engines did not sample from the trainer's weights after a sync, from its metrics.jsonl rows;
    None when they did (every step's vllm/logprob_diff at most twice step 1's plus SYNC_SLACK)."""
    diffs = [row["vllm/logprob_diff"] for row in rows if "vllm/logprob_diff" in row]
    if not diffs:
        return "no step logged vllm/logprob_diff"
    limit = 2 * diffs[0] + SYNC_SLACK
    wrong = [(step, diff) for step, diff in enumerate(diffs, 1) if diff > limit and stage not in STALE_BY_DESIGN]
    if wrong:
        steps = ", ".join(f"step {step} {diff:.2g}" for step, diff in wrong)
        return (f"vLLM's log-probs differ from the trainer's after a sync: {steps} (step 1 {diffs[0]:.2g}, at most "
                f"{limit:.2g}); the engines did not load the trainer's weights")
    return None


def planned_gib(cmd: list[str], gpu_gib: float) -> float | None:
    """The memory plan's busiest GPU (GiB) for a ppo_ray.py command, or None for another script or without a plan."""
    if "ppo_ray.py" not in cmd:
        return None
    import ppo_ray
    from common import memory_plan
    from common.args import parse_args

    args = parse_args(ppo_ray.Args, cmd[cmd.index("ppo_ray.py") + 1:] + ["--gpu_memory_gib", f"{gpu_gib:g}"])
    try:
        groups = memory_plan.plan(args)
    except memory_plan.PlanSkipped:
        return None
    return max(sum(memory_plan.gpu_bytes(need) for need in roles.values()) for _, roles in groups.values()) / 2**30


def gpu_memory_mib(field: str) -> list[float]:
    """nvidia-smi's `field` (memory.used, memory.total) of every GPU, in MiB: read without a CUDA context of this
    process's own, which would hold memory on GPU 0 through every stage."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True).stdout
    return [float(v) for v in out.split()]


class PeakMemory:
    """The most memory any GPU held while the block ran, in GiB, from nvidia-smi every half second (every process on
    the GPU counts: run the smoke on GPUs of its own)."""

    def __enter__(self):
        self.peak, self.done = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while not self.done.wait(0.5):
            self.peak = max([self.peak] + [used / 1024 for used in gpu_memory_mib("memory.used")])

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def table(rows: list[dict]) -> str:
    """One line per stage: seconds, peak GPU memory against the plan, vllm/logprob_diff (step 1 -> the largest after
    it), result."""
    lines = [f"{'stage':12} {'seconds':>7} {'peak GiB':>8} {'plan GiB':>8}  {'logprob_diff':22} result"]
    for r in rows:
        plan = f"{r['plan']:.1f}" if r.get("plan") is not None else "-"
        diffs = r.get("diffs") or []
        diff = f"{diffs[0]:.1e} -> {max(diffs[1:]):.1e}" if len(diffs) > 1 else (
            f"{diffs[0]:.1e}" if diffs else "-")
        lines.append(f"{r['stage']:12} {r['seconds']:7.0f} {r['peak']:8.1f} {plan:>8}  {diff:22} {r['result']}")
    return "\n".join(lines)


def run_stage(stage: str, cmd: list[str], out: str, gpu_gib: float) -> dict:
    """Run one stage into <out>/<stage>.log; its table row, with the reason it failed (None if it passed)."""
    log = os.path.join(out, stage + ".log")
    start = time.time()
    with PeakMemory() as memory, open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    row = {"stage": stage, "seconds": time.time() - start, "peak": memory.peak, "plan": planned_gib(cmd, gpu_gib),
           "failure": None if code == 0 else f"exit {code}"}
    metrics = os.path.join(out, stage, "metrics.jsonl")
    if code == 0 and "ppo_ray.py" in cmd:
        with open(metrics) as f:
            rows = [json.loads(line) for line in f]
        row["diffs"] = [r["vllm/logprob_diff"] for r in rows if "vllm/logprob_diff" in r]
        row["failure"] = check_sync(stage, rows)
    row["result"] = "ok" if row["failure"] is None else "FAILED"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu_smoke", help="output folder (emptied first)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: make gpu-smoke checks the CUDA paths and this machine has no CUDA GPU; on CPU run make demo.")
    gpus = torch.cuda.device_count()
    gpu_gib = min(gpu_memory_mib("memory.total")) / 1024
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    flash_attn = importlib.util.find_spec("flash_attn") is not None
    stages = commands(os.path.abspath(args.out), gpus, flash_attn)
    for line in skipped(gpus, flash_attn):
        print(line)
    rows = []
    for stage, cmd in stages:
        row = run_stage(stage, cmd, os.path.abspath(args.out), gpu_gib)
        rows.append(row)
        print(f"{stage:11} {row['result']} in {row['seconds']:.0f} s", flush=True)
        if row["failure"] is None:
            continue
        log = os.path.join(args.out, stage + ".log")
        with open(log) as f:
            tail = f.read().splitlines()[-25:]
        print(f"{stage:11} FAILED ({row['failure']}); the end of {log}:\n  " + "\n  ".join(tail)
              + f"\n  rerun: {shlex.join(cmd)}")
        if stage in ("base", "task", "sft"):  # every later stage starts from these
            break
    print(table(rows))
    failed = [row["stage"] for row in rows if row["failure"] is not None]
    print("gpu-smoke: " + (f"{len(failed)} stage(s) failed: {', '.join(failed)}" if failed else "every stage ran"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
