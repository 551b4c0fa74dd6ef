"""Tokens per second of sft.py: tiny and ~100M-parameter models, with and without packing, 1 and 2 ranks, ZeRO-2/3.

Runs sft.py as a user would (`python sft.py` or the deepspeed launcher) on the synthetic task and reads the
`perf/tokens_per_sec` it logs (real tokens, padding excluded), averaged over the steps after the first.

    python bench/bench_sft.py [--out out/bench_sft] [--quick]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.synthetic_task import write_task  # noqa: E402
from common.tiny_model import write_tiny_model  # noqa: E402

MODELS = {"tiny": {}, "100M": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4}}


def run_sft(model_dir, data, out, ranks, zero, packing, steps, batch):
    args = ["--pretrain", model_dir, "--dataset", data, "--apply_chat_template", "--output_dir", out,
            "--max_steps", str(steps), "--train_batch_size", str(batch), "--micro_train_batch_size",
            str(batch // ranks), "--zero_stage", str(zero), "--packing_samples", str(packing).lower()]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "deepspeed.launcher.runner",
                                                    "--num_gpus", str(ranks), "--master_port", "29611"]
    start = time.time()
    subprocess.run([*launcher, os.path.join(ROOT, "sft.py"), *args], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rates = [json.loads(line)["perf/tokens_per_sec"] for line in f][1:]
    return statistics.mean(rates), wall


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_sft")
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = write_task(os.path.join(args.out, "task"), n_train=2000)["sft_train"]
    rows = []
    for name, shape in MODELS.items():
        if args.quick and name != "tiny":
            continue
        model_dir = write_tiny_model(os.path.join(args.out, name), **shape)
        steps, batch = (30, 32) if name == "tiny" else (4, 16)
        for ranks in (1, 2):
            for zero in (2, 3):
                for packing in (False, True):
                    out = os.path.join(args.out, f"{name}-r{ranks}-z{zero}-p{int(packing)}")
                    rate, wall = run_sft(model_dir, data, out, ranks, zero, packing, steps, batch)
                    rows.append((name, ranks, zero, packing, rate, wall))
                    print(f"{name:5s} ranks={ranks} zero={zero} packing={packing!s:5s} "
                          f"{rate:9.0f} tokens/s   (run {wall:.0f} s)", flush=True)
    print("\n| model | ranks | ZeRO | packing | tokens/s |\n|---|---|---|---|---|")
    for name, ranks, zero, packing, rate, _ in rows:
        print(f"| {name} | {ranks} | {zero} | {'yes' if packing else 'no'} | {rate:.0f} |")


if __name__ == "__main__":
    main()
