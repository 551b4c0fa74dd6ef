"""Pairs per second of rm.py and dpo.py, and the reference forward pass's share of a DPO step.

The configurations of bench_sft.py (tiny and ~100M-parameter models, 1 and 2 ranks, ZeRO-2/3), run as a user would
(`python script.py` or the deepspeed launcher) on the synthetic task's preference pairs. Reads the
`perf/pairs_per_sec` and `perf/ref_forward_share` the scripts log, averaged over the steps after the first.

    python bench/bench_preference.py [--out out/bench_preference] [--quick]
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


def run(script, model_dir, data, eval_data, out, ranks, zero, steps, batch):
    # rm.py ends by scoring --eval_dataset for its reward statistics: a few pairs keep that out of the timing.
    args = ["--pretrain", model_dir, "--dataset", data, "--eval_dataset", eval_data, "--apply_chat_template",
            "--output_dir", out, "--max_steps", str(steps), "--train_batch_size", str(batch),
            "--micro_train_batch_size", str(batch // ranks), "--zero_stage", str(zero), "--learning_rate", "1e-5"]
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "deepspeed.launcher.runner",
                                                    "--num_gpus", str(ranks), "--master_port", "29612"]
    start = time.time()
    subprocess.run([*launcher, os.path.join(ROOT, script), *args], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps_logged = [m for m in map(json.loads, f) if "perf/pairs_per_sec" in m][1:]
    rate = statistics.mean(m["perf/pairs_per_sec"] for m in steps_logged)
    ref_share = statistics.mean(m["perf/ref_forward_share"] for m in steps_logged) if script == "dpo.py" else None
    return rate, ref_share, wall


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_preference")
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    files = write_task(os.path.join(args.out, "task"), n_train=2000, n_eval=16)
    data, eval_data = files["pref_train"], files["pref_eval"]
    rows = []
    for name, shape in MODELS.items():
        if args.quick and name != "tiny":
            continue
        model_dir = write_tiny_model(os.path.join(args.out, name), **shape)
        steps, batch = (20, 32) if name == "tiny" else (4, 8)
        for script in ("rm.py", "dpo.py"):
            for ranks in (1, 2):
                for zero in (2, 3):
                    out = os.path.join(args.out, f"{script[:-3]}-{name}-r{ranks}-z{zero}")
                    rate, ref_share, wall = run(script, model_dir, data, eval_data, out, ranks, zero, steps, batch)
                    rows.append((script, name, ranks, zero, rate, ref_share))
                    share = f"   reference forward {ref_share:.0%} of a step" if ref_share is not None else ""
                    print(f"{script:6s} {name:5s} ranks={ranks} zero={zero} {rate:8.1f} pairs/s{share}   "
                          f"(run {wall:.0f} s)", flush=True)
    print("\n| script | model | ranks | ZeRO | pairs/s | reference forward share |\n|---|---|---|---|---|---|")
    for script, name, ranks, zero, rate, ref_share in rows:
        share = f"{ref_share:.0%}" if ref_share is not None else "-"
        print(f"| {script} | {name} | {ranks} | {zero} | {rate:.1f} | {share} |")


if __name__ == "__main__":
    main()
