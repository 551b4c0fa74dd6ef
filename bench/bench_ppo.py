"""Where a PPO step's time goes, and how close each phase comes to its own limit, measured in the same run.

For each model size (the tiny test model and a ~100M-parameter Llama from a config, both untrained: timing does not
need a good policy) this runs ppo_ray.py as a user would, PPO with GAE (actor, critic, reference, rule reward, one
vLLM engine), and reads what it logs per step: time/generate, time/make_experience, time/train, time/weight_sync.
Then a fresh process with no Ray, no DeepSpeed and all the cores (and the trainers' allocator setting,
common/deepspeed_utils.keep_freed_cpu_memory) measures each phase's limit on the same work:

- generation: a standalone `vllm.LLM` (the engine settings ppo_ray.py uses) samples the same number of prompts of
  the task, with the same samples per prompt, temperature and length limit; the ratio is of the token rates;
- experience: plain `torch.no_grad()` forwards of the models the phase runs (actor and reference log-probs, critic
  values) over the last rollout's sequences, in the same micro-batches;
- train: a plain forward + backward of the actor (and the critic) on the same micro-batches and one AdamW step
  each (torch's fused kernel, the fastest it has), as one PPO step with one epoch does;
- sync: one raw gloo broadcast of the model's bytes to another process, which loads nothing.

A ratio is the limit's time over the phase's (generation: ppo_ray.py's token rate over the engine's), so 1.0 is at
the limit and 0.5 twice as slow; the sync's is the other way round, its time over the raw broadcast's. The first
step of each is a warm-up and is left out; a limit is the mean of a few repeats after a warm-up.

    .venv/bin/python bench/bench_ppo.py                     # tiny and 100M (about 12 minutes on 2 CPU cores)
    .venv/bin/python bench/bench_ppo.py --models tiny
"""

import json
import multiprocessing
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
REPEATS = 3  # timed repeats of each limit, after one warm-up; their mean counts, as the steps' mean does for ppo_ray


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    """model sizes to time, from: tiny, 100M"""
    out: str = "out/bench_ppo"
    """folder for the models, the task and the runs' logs"""
    limits: str | None = None
    """(internal) measure only the limits for this model folder and print them as JSON"""
    model: str = "tiny"
    """(internal) the MODELS entry whose settings the limits use"""


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


def mean_seconds(fn) -> float:
    fn()  # warm-up: first-touch allocations, lazy initialisation
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def generation_limit(model_dir: str, prompts_file: str, settings: dict):
    """A bare vllm.LLM samples settings["steps"] rollouts of the task's prompts: its tokens/s after the first, the
    mean length, and the last rollout as (prompt ids, samples) for the other limits."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as inside ppo_ray.py's engine actor
    import torch
    import vllm
    from transformers import AutoTokenizer

    from common.data import load_records, render_prompt
    from common.vllm_engine import trainer_dtype

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_prompts = settings["rollout_batch_size"]
    records = load_records(prompts_file)[:n_prompts * settings["steps"]]
    texts = [render_prompt(tokenizer, r["prompt"], True, None) for r in records]  # as common/data.load_prompts
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    gpu = torch.cuda.is_available()
    llm = vllm.LLM(model=model_dir, seed=42, max_model_len=PROMPT_MAX_LEN + settings["generate_max_len"],
                   dtype=trainer_dtype(gpu), enforce_eager=not gpu, logprobs_mode="processed_logprobs")
    params = vllm.SamplingParams(n=settings["n_samples_per_prompt"], temperature=1.0,
                                 max_tokens=settings["generate_max_len"], logprobs=0)
    rates, lengths = [], []
    for step in range(settings["steps"]):
        ids = prompt_ids[step * n_prompts:(step + 1) * n_prompts]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [len(c.token_ids) for o in outputs for c in o.outputs]
        rates.append(sum(tokens) / seconds)
        lengths.append(statistics.mean(tokens))
    samples = [[{"token_ids": list(c.token_ids), "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs]}
                for c in o.outputs] for o in outputs]
    return statistics.mean(rates[1:]), statistics.mean(lengths[1:]), (ids, samples, tokenizer)


def micro_batches(batch: dict, size: int) -> list[dict]:
    """Consecutive micro-batches of `size` rows, cut to the longest row in each, as common/model_worker.split does."""
    out = []
    for i in range(0, len(batch["input_ids"]), size):
        length = int(batch["attention_mask"][i:i + size].sum(1).max())
        out.append({k: batch[k][i:i + size, :length] for k in ("input_ids", "attention_mask", "position_ids")}
                   | {"action_mask": batch["action_mask"][i:i + size, :length - 1]})
    return out


def experience_and_train_limits(model_dir: str, batch: dict, settings: dict) -> dict:
    """Plain torch on all cores: no_grad forwards of the actor, reference and critic over the batch, then one
    training step of the actor and of the critic (forward + backward per micro-batch, one fused AdamW step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from common.modeling import next_token_logprobs, token_values

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    micro = micro_batches(batch, settings["micro_train_batch_size"])

    def forwards():  # the experience phase: actor and reference log-probs (one model, twice), critic values
        actor.eval()
        critic.eval()
        with torch.no_grad():
            for model in (actor, actor):
                for mb in micro:
                    next_token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"])
            for mb in micro:
                token_values(critic, mb["input_ids"], mb["attention_mask"])

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-7, fused=True) for m in (actor, critic)]  # torch's fastest

    def train():  # a loss of the same shape as PPO's: a masked mean over the response tokens
        actor.train()
        critic.train()
        for mb in micro:
            mask = mb["action_mask"]
            logprobs = next_token_logprobs(actor, mb["input_ids"], mb["attention_mask"], mb["position_ids"])
            (-(logprobs * mask).sum() / mask.sum()).backward()
        for mb in micro:
            mask = mb["action_mask"]
            values = token_values(critic, mb["input_ids"], mb["attention_mask"])[:, :-1]
            ((values ** 2 * mask).sum() / mask.sum()).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    return {"experience": mean_seconds(forwards), "train": mean_seconds(train),
            "sync_bytes": sum(p.numel() * p.element_size() for p in actor.parameters())}


def receive_broadcasts(port: int, numel: int, times: int) -> None:
    """The raw broadcast's other end, in a process of its own: joins the two-rank group and receives `times`, into
    one buffer, as the sync's engine workers keep theirs (a fresh one each time adds its first touch's page faults,
    which made this limit up to 2.6 times as slow)."""
    import torch

    from common.weight_sync import new_process_group

    group = new_process_group("127.0.0.1", port, 1, 2, "gloo")
    buffer = torch.empty(numel, dtype=torch.float32)
    for _ in range(times):
        group.broadcast(buffer, 0).wait()


def broadcast_limit(nbytes: int) -> float:
    """One gloo broadcast of `nbytes` from this process to another, which only receives."""
    import torch

    from common.net import free_port
    from common.weight_sync import new_process_group

    port, numel = free_port(), nbytes // 4
    receiver = multiprocessing.get_context("spawn").Process(target=receive_broadcasts,
                                                            args=(port, numel, REPEATS + 1))
    receiver.start()
    group = new_process_group("127.0.0.1", port, 0, 2, "gloo")
    flat = torch.randn(numel)
    seconds = mean_seconds(lambda: group.broadcast(flat, 0).wait())
    receiver.join()
    return seconds


def limits(model_dir: str, prompts_file: str, settings: dict) -> dict:
    from ppo_ray import build_batch

    tokens_per_sec, length, (prompt_ids, samples, tokenizer) = generation_limit(model_dir, prompts_file, settings)
    batch = build_batch(prompt_ids, samples, tokenizer.pad_token_id)
    out = experience_and_train_limits(model_dir, batch, settings)
    return {"tokens_per_sec": tokens_per_sec, "length": length, "experience": out["experience"],
            "train": out["train"], "sync": broadcast_limit(out["sync_bytes"])}


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
    # The limits in a fresh process, so that nothing of this one (threads, memory) is shared with them.
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--limits", model_dir, "--model", name,
                             "--out", args.out], cwd=ROOT, check=True, capture_output=True, text=True)
    row["limits"] = json.loads(result.stdout.strip().splitlines()[-1])
    return row


def main(args: Args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.limits:
        from common.deepspeed_utils import keep_freed_cpu_memory

        keep_freed_cpu_memory()  # as every trainer has it: the limit is the fastest the same work can go
        prompts = os.path.join(args.out, "task", "prompts_train.jsonl")
        print(json.dumps(limits(args.limits, prompts, MODELS[args.model][1])))
        return
    rows = [bench_one(name, args) for name in args.models]
    print("\nseconds per PPO step (mean over the steps after the first; GAE, actor + critic + reference, one engine)")
    print(f"{'model':>6} {'generate':>9} {'experience':>10} {'train':>8} {'sync':>8} {'(vLLM load)':>11} {'total':>8}")
    for r in rows:
        total = sum(r[k] for k in PHASES)
        print(f"{r['model']:>6} " + " ".join(f"{r[k]:>{w}.2f}" for k, w in zip(PHASES, (9, 10, 8, 8)))
              + f" {r['vllm_load']:>11.2f} {total:>8.2f}")
    print("\neach phase against its limit, measured in the same run (ratio: limit / phase, 1.0 = at the limit; "
          "sync: phase / raw)")
    print(f"{'model':>6} {'generate tok/s':>21} {'experience s':>21} {'train s':>21} {'sync s':>21}")
    print(f"{'':>6} " + " ".join(f"{'ppo / limit = ratio':>21}" for _ in range(4)))
    for r in rows:
        lim = r["limits"]
        cells = [(r["ppo_tokens_per_sec"], lim["tokens_per_sec"], r["ppo_tokens_per_sec"] / lim["tokens_per_sec"]),
                 (r["time/make_experience"], lim["experience"], lim["experience"] / r["time/make_experience"]),
                 (r["time/train"], lim["train"], lim["train"] / r["time/train"]),
                 (r["time/weight_sync"], lim["sync"], r["time/weight_sync"] / lim["sync"])]
        text = [f"{a:{f}} / {b:{f}} = {c:.2f}" for (a, b, c), f in zip(cells, (".0f", ".2f", ".2f", ".3f"))]
        print(f"{r['model']:>6} " + " ".join(f"{t:>21}" for t in text))
    ppo_lengths = ", ".join(f"{r['ppo_length']:.1f}" for r in rows)
    engine_lengths = ", ".join(f"{r['limits']['length']:.1f}" for r in rows)
    print(f"\n(mean response length: ppo_ray.py {ppo_lengths}; standalone engine {engine_lengths})")


if __name__ == "__main__":
    main(parse_args(Args))
