"""Memory and speed of dpo.py with LoRA against full fine-tuning, on a ~100M-parameter model.

DPO holds the most per rank of the single-process trainers: the policy, its gradients and AdamW state, and a frozen
reference. With LoRA the reference is the policy's own base model with the adapters off, and only the adapters
have gradients and optimizer state. Each run is `python dpo.py` (one rank, ZeRO-0, fp32 on CPU); its peak resident
memory is the process's own high-water mark (ru_maxrss of the finished child), its speed the `perf/pairs_per_sec`
it logs, averaged over the steps after the first.

    python bench/bench_lora.py [--out out/bench_lora] [--steps 6]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.synthetic_task import write_task  # noqa: E402
from common.tiny_model import write_tiny_model  # noqa: E402

SHAPE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4}


def run(model_dir: str, data: str, out: str, steps: int, extra: list[str]) -> tuple[float, float]:
    """(peak resident MiB, pairs/s) of one dpo.py run, alone in its process."""
    cmd = [sys.executable, os.path.join(ROOT, "dpo.py"), "--pretrain", model_dir, "--dataset", data,
           "--apply_chat_template", "--output_dir", out, "--max_steps", str(steps), "--train_batch_size", "8",
           "--micro_train_batch_size", "8", "--zero_stage", "0", "--learning_rate", "1e-5", *extra]
    # A child of its own, waited for by os.wait4, so that its rusage is its own and not the sum of every run's.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; rerun it to see why.")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [m["perf/pairs_per_sec"] for m in map(json.loads, f) if "perf/pairs_per_sec" in m][1:]
    return usage.ru_maxrss / 1024, statistics.mean(logged)  # ru_maxrss is in KiB on Linux


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_lora")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = write_task(os.path.join(args.out, "task"), n_train=400, n_eval=16)["pref_train"]
    model_dir = write_tiny_model(os.path.join(args.out, "model"), **SHAPE)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the parameter count, without allocating the weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    params = sum(p.numel() for p in model.parameters())
    runs = {"full fine-tuning": [], "LoRA r=16, all-linear": ["--lora_rank", "16", "--lora_alpha", "32"]}
    rows = []
    for name, extra in runs.items():
        peak, rate = run(model_dir, data, os.path.join(args.out, name.split()[0].lower()), args.steps, extra)
        rows.append((name, peak, rate))
    print(f"dpo.py, {params / 1e6:.0f}M-parameter model, fp32, 1 rank, batch 8 pairs, {args.steps} steps, "
          f"{os.cpu_count()} CPU cores")
    print("| run | peak resident memory | pairs/s |\n|---|---|---|")
    for name, peak, rate in rows:
        print(f"| {name} | {peak:,.0f} MiB | {rate:.2f} |")
    saved = rows[0][1] - rows[1][1]
    print(f"LoRA saves {saved:,.0f} MiB; a frozen fp32 copy of the weights is {params * 4 / 2**20:,.0f} MiB and "
          f"AdamW's two fp32 moments {params * 8 / 2**20:,.0f} MiB.")


if __name__ == "__main__":
    main()
