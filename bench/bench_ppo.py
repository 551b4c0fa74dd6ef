"""Where a PPO step's time goes, and how fast ppo_ray.py generates next to a standalone vLLM engine.

For each model size (the tiny test model and a ~100M-parameter Llama from a config, both untrained: timing does not
need a good policy) this runs ppo_ray.py as a user would, PPO with GAE (actor, critic, reference, rule reward, one
vLLM engine), and reads what it logs per step: time/generate, time/make_experience, time/train, time/weight_sync
(with the part vLLM spends loading the weights) and perf/rollout_tokens_per_sec. Then a standalone vLLM engine
(`vllm.LLM` in a process of its own, no Ray, the engine settings ppo_ray.py uses) samples the same number of
prompts of the same task, with the same samples per prompt, temperature and length limit, and the ratio of the two
token rates is reported. The first step of each is a warm-up and is left out.

    .venv/bin/python bench/bench_ppo.py                     # tiny and 100M (about 10 minutes on 2 CPU cores)
    .venv/bin/python bench/bench_ppo.py --models tiny
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.args import parse_args  # noqa: E402

# name -> (write_tiny_model keyword arguments, ppo_ray.py settings of one step)
MODELS = {
    "tiny": ({}, {"steps": 6, "rollout_batch_size": 64, "n_samples_per_prompt": 8, "generate_max_len": 16,
                  "train_batch_size": 256, "micro_train_batch_size": 64}),
    "100M": ({"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4},
             {"steps": 3, "rollout_batch_size": 16, "n_samples_per_prompt": 4, "generate_max_len": 32,
              "train_batch_size": 64, "micro_train_batch_size": 16}),
}
PROMPT_MAX_LEN = 64
PHASES = ("time/generate", "time/make_experience", "time/train", "time/weight_sync")


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    """model sizes to time, from: tiny, 100M"""
    out: str = "out/bench_ppo"
    """folder for the models, the task and the runs' logs"""
    standalone: str | None = None
    """(internal) run only the standalone-engine half for this model folder and print its tokens/s as JSON"""
    model: str = "tiny"
    """(internal) the MODELS entry whose settings the standalone half uses"""


def run_ppo(model_dir: str, task: dict, out: str, settings: dict) -> list[dict]:
    """ppo_ray.py for settings["steps"] steps; returns its per-step metrics."""
    flags = {k: v for k, v in settings.items() if k != "steps"}
    cmd = [sys.executable, os.path.join(ROOT, "ppo_ray.py"), "--pretrain", model_dir, "--critic_pretrain", model_dir,
           "--reward_fn", os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn",
           "--prompt_data", task["prompts_train"], "--apply_chat_template", "--prompt_max_len", str(PROMPT_MAX_LEN),
           "--advantage_estimator", "gae", "--max_steps", str(settings["steps"]), "--output_dir", out,
           *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "time/generate" in m]


def standalone_tokens_per_sec(model_dir: str, prompts_file: str, settings: dict) -> dict:
    """Sample settings["steps"] rollouts of the task's prompts with a bare vllm.LLM; tokens/s after the first."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as inside ppo_ray.py's engine actor
    import torch
    import vllm
    from transformers import AutoTokenizer

    from common.data import load_records, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_prompts = settings["rollout_batch_size"]
    records = load_records(prompts_file)[:n_prompts * settings["steps"]]
    texts = [render_prompt(tokenizer, r["prompt"], True, None) for r in records]  # as ppo_ray.py's load_prompts
    prompts = [{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts]
    gpu = torch.cuda.is_available()
    llm = vllm.LLM(model=model_dir, seed=42, max_model_len=PROMPT_MAX_LEN + settings["generate_max_len"],
                   dtype="auto" if gpu else "float32", enforce_eager=not gpu, logprobs_mode="processed_logprobs")
    params = vllm.SamplingParams(n=settings["n_samples_per_prompt"], temperature=1.0,
                                 max_tokens=settings["generate_max_len"], logprobs=0)
    rates, lengths = [], []
    for step in range(settings["steps"]):
        start = time.perf_counter()
        outputs = llm.generate(prompts[step * n_prompts:(step + 1) * n_prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [len(c.token_ids) for o in outputs for c in o.outputs]
        rates.append(sum(tokens) / seconds)
        lengths.append(statistics.mean(tokens))
    return {"tokens_per_sec": statistics.mean(rates[1:]), "length": statistics.mean(lengths[1:])}


def bench_one(name: str, args: Args) -> dict:
    from common.synthetic_task import write_task
    from common.tiny_model import write_tiny_model

    shape, settings = MODELS[name]
    model_dir = write_tiny_model(os.path.join(args.out, name), seed=0, **shape)
    task = write_task(os.path.join(args.out, "task"))
    log = run_ppo(model_dir, task, os.path.join(args.out, f"ppo-{name}"), settings)[1:]
    row = {"model": name, **{k: statistics.mean(m[k] for m in log) for k in PHASES},
           "vllm_load": statistics.mean(m["weight_sync/vllm_load"] for m in log),
           "ppo_tokens_per_sec": statistics.mean(m["perf/rollout_tokens_per_sec"] for m in log),
           "ppo_length": statistics.mean(m["response/length"] for m in log)}
    # The standalone engine in a fresh process, so that nothing of this one (threads, memory) is shared with it.
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--standalone", model_dir, "--model", name,
                             "--out", args.out], cwd=ROOT, check=True, capture_output=True, text=True)
    standalone = json.loads(result.stdout.strip().splitlines()[-1])
    row.update(standalone_tokens_per_sec=standalone["tokens_per_sec"], standalone_length=standalone["length"])
    return row


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.standalone:
        prompts = os.path.join(args.out, "task", "prompts_train.jsonl")
        print(json.dumps(standalone_tokens_per_sec(args.standalone, prompts, MODELS[args.model][1])))
        return
    rows = [bench_one(name, args) for name in args.models]
    print("\nseconds per PPO step (mean over the steps after the first; GAE, actor + critic + reference, one engine)")
    print(f"{'model':>6} {'generate':>9} {'experience':>10} {'train':>8} {'sync':>8} {'(vLLM load)':>11} {'total':>8}")
    for r in rows:
        total = sum(r[k] for k in PHASES)
        print(f"{r['model']:>6} " + " ".join(f"{r[k]:>{w}.2f}" for k, w in zip(PHASES, (9, 10, 8, 8)))
              + f" {r['vllm_load']:>11.2f} {total:>8.2f}")
    print("\nrollout tokens/s: inside ppo_ray.py vs a standalone vLLM engine (same prompts, n, length limit)")
    print(f"{'model':>6} {'ppo_ray':>9} {'(mean len)':>10} {'standalone':>10} {'(mean len)':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:>6} {r['ppo_tokens_per_sec']:>9.0f} {r['ppo_length']:>10.1f} "
              f"{r['standalone_tokens_per_sec']:>10.0f} {r['standalone_length']:>10.1f} "
              f"{r['ppo_tokens_per_sec'] / r['standalone_tokens_per_sec']:>6.2f}")


if __name__ == "__main__":
    main(parse_args(Args))
