"""How far each learning result sits from its threshold, away from the trajectory it was tuned on.

Runs the learning tests (`pytest -m learning`) once per seed and thread count, each with RLHF_TEST_SEED and
RLHF_TEST_THREADS set (see conftest.py), collects every quantity the tests check with `expect`, and prints a table
of min / median / max of each next to its threshold. Training on CPU is reproducible on one machine but not across
machines (float kernels and reduction orders differ); seeds and thread counts are how this machine imitates others.
Run it after changing a learning test, a fixture or a recipe, and set thresholds about halfway between chance (or
the starting value) and the typical result.

    .venv/bin/python tests/measure_margins.py --seeds 0 1 2 --threads default 1 --jobs 2
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_variant(seed: int, threads: str, out: str, select: str | None) -> subprocess.Popen:
    """Start one pytest session of the learning tests with this seed and thread count."""
    name = f"seed{seed}_threads{threads}"
    env = dict(os.environ, RLHF_TEST_SEED=str(seed), RLHF_MARGINS_FILE=os.path.join(out, name + ".jsonl"))
    env.pop("RLHF_TEST_THREADS", None)
    if threads != "default":
        env["RLHF_TEST_THREADS"] = threads
    # A temp folder per variant: the vLLM rendezvous files that conftest.run_script counts are then this variant's,
    # not those of one running beside it (--jobs). Ray keeps its session folders where they were.
    env.setdefault("RAY_TMPDIR", tempfile.gettempdir())
    env["TMPDIR"] = tempfile.mkdtemp(prefix=f"margins_{seed}{threads[0]}_")
    if os.path.exists(env["RLHF_MARGINS_FILE"]):
        os.remove(env["RLHF_MARGINS_FILE"])
    cmd = [sys.executable, "-m", "pytest", "-m", "learning", "-q", "-p", "no:cacheprovider",
           "--basetemp", os.path.join(out, "tmp_" + name), *(["-k", select] if select else [])]
    log = open(os.path.join(out, name + ".log"), "w")
    print(f"started {name}: log {os.path.relpath(log.name)}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def table(out: str) -> str:
    """Markdown: one row per (test, quantity) with min / median / max over the variants, and the threshold."""
    rows = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".jsonl"):
            for line in open(os.path.join(out, name)):
                r = json.loads(line)
                rows.setdefault((r["quantity"], r["op"], r["threshold"]), []).append(r["value"])
    lines = ["| quantity | threshold | min | median | max | runs | worst margin |", "|---|---|---|---|---|---|---|"]
    for (quantity, op, threshold), values in sorted(rows.items()):
        worst = min(values) - threshold if op == ">=" else threshold - max(values)
        lines.append(f"| {quantity} | {op} {threshold:g} | {min(values):.3f} | {statistics.median(values):.3f} | "
                     f"{max(values):.3f} | {len(values)} | {worst:+.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="values of RLHF_TEST_SEED")
    parser.add_argument("--threads", nargs="+", default=["default", "1"], help="CPU threads ('default' or a number)")
    parser.add_argument("--jobs", type=int, default=1, help="variants run at once")
    parser.add_argument("-k", dest="select", default=None, help="only the learning tests matching this expression")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "margins"), help="logs, records and table.md")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pending = list(itertools.product(args.seeds, args.threads))
    running, failed, start = [], [], time.time()
    while pending or running:
        while pending and len(running) < args.jobs:
            seed, threads = pending.pop(0)
            running.append((f"seed{seed}_threads{threads}", run_variant(seed, threads, args.out, args.select)))
        time.sleep(2)
        for name, proc in [r for r in running if r[1].poll() is not None]:
            running.remove((name, proc))
            print(f"finished {name}: exit {proc.returncode} after {time.time() - start:.0f} s", flush=True)
            failed += [name] if proc.returncode else []
    result = table(args.out)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(result + "\n")
    print(result)
    if failed:
        sys.exit(f"some learning test failed in: {', '.join(failed)} (see their logs in {args.out})")


if __name__ == "__main__":
    main()
