"""sft.py's training step on one GPU against a plain PyTorch loop, piece by piece: where the time goes.

launch/gpu_trainers.py measures sft.py end to end next to a plain transformers + torch AdamW loop; this splits the
difference. Each variant trains the same model on the same (micro-batch 4 x 2048 tokens, 4 micro-batches a step)
batches in a process of its own, and reports tokens/s over the steps after the first:

    plain        transformers' own loss, torch AdamW (fused), bf16 weights: the limit
    plain_ours   the same model and optimizer with sft.py's loss (fp32 next-token log-probs, the attention mask)
    ds0 .. ds3   sft.py's step: common.deepspeed_utils' model and DeepSpeed engine at ZeRO stage N, sft.py's loss
                 (ds1 is what sft.py runs on one GPU)
    *_compile    the same with each decoder layer compiled (sft.py --torch_compile; plain_compile: the plain loop's)

Each variant also reports its first micro-batch's loss: the same model on the same tokens, they must agree (to bf16's
rounding) for a faster variant to count.

and one step of `--profile` (default ds1) under torch.profiler: the kernels that take the most GPU time and how long
the CPU spent, which says whether the step waits on the GPU or on Python.

    python bench/bench_sft_gpu.py --model out/gpu_trainers/base-1b --data out/gpu_trainers/long.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

SEQ, MICRO, BATCH = 2048, 4, 16
VARIANTS = ["plain", "ds1", "plain_ours", "ds0", "ds2", "ds3", "plain_compile", "ds1_compile"]


def batches(model_path: str, data: str, device) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with open(data) as f:
        texts = [json.loads(line)["text"] for line in f][:BATCH]
    return torch.tensor([tokenizer(t)["input_ids"][:SEQ] for t in texts], device=device)  # (BATCH, SEQ)


def train_step_fn(variant: str, model_path: str, ids: torch.Tensor, losses: list):
    """A function running one optimizer step of `variant` over `ids`, appending each micro-batch's loss to `losses`."""
    from sft import forward_logprobs, sft_loss

    accumulation = BATCH // MICRO
    ones = torch.ones_like(ids[:MICRO])
    tokens = torch.tensor(float(ids.numel()), device=ids.device)  # every token is trained (pretraining mode)

    def ours(model, micro):
        batch = {"input_ids": micro, "attention_mask": ones, "loss_mask": ones}
        return sft_loss(forward_logprobs(model, batch), batch["loss_mask"], tokens) * accumulation

    if variant.startswith("plain"):
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        model = model.to(ids.device).train()
        if variant.endswith("_compile"):
            from common.deepspeed_utils import compile_blocks

            model.config.use_cache = False  # as load_model sets: a cache's layer index would give each layer a graph
            compile_blocks(model, model_path)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())

        def step():
            for micro in ids.split(MICRO):
                # DeepSpeed divides each micro-batch's loss by the accumulation steps; a plain loop does it itself
                loss = (ours(model, micro) if variant == "plain_ours" else model(input_ids=micro, labels=micro).loss)
                losses.append(loss.detach())
                loss = loss / accumulation
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step

    from common.deepspeed_utils import ds_config, init_distributed, init_train_engine, load_model

    init_distributed()
    config = ds_config(int(variant[2]), BATCH, MICRO, 1)
    model = load_model(model_path, config, dropout=True, torch_compile=variant.endswith("_compile"))
    engine = init_train_engine(model, config, 1e-5, 0.0, 100, 0.0, 0.1)

    def step():
        for micro in ids.split(MICRO):
            loss = ours(engine, micro)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())  # sft.py sums them on the device, read once a step
    return step


def run_variant(variant: str, model_path: str, data: str, steps: int, profile_out: str | None) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = batches(model_path, data, device)
    losses = []
    step = train_step_fn(variant, model_path, ids, losses)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    rate = ids.numel() / (sum(times[1:]) / len(times[1:]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(json.dumps({"variant": variant, "tokens_per_s": rate, "step_s": times, "peak_gib": peak,
                      "first_loss": losses[0].item()}), flush=True)
    if profile_out:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        wall = time.perf_counter()
        with profile(activities=activities) as prof:
            step()
            sync()
        wall = time.perf_counter() - wall
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)
        with open(profile_out, "w") as f:
            f.write(f"{variant}: one step, {wall:.3f} s wall under the profiler\n{table}\n")
        print(f"{variant} profile -> {profile_out}\n" + "\n".join(table.splitlines()[:30]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="JSONL of {'text'} rows of at least 2048 tokens")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", default="ds1", help="the variant to profile for one step ('' for none)")
    parser.add_argument("--out", default="out/bench_sft_gpu")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's one variant
    args = parser.parse_args()
    if args.variant:
        profile_out = os.path.join(args.out, f"profile_{args.variant}.txt") if args.variant == args.profile else None
        run_variant(args.variant, args.model, args.data, args.steps, profile_out)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = {}
    for variant in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant], cwd=ROOT,
                             capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            print(f"{variant}: FAILED (rc {out.returncode})\n{out.stderr[-2500:]}", flush=True)
            continue
        rows[variant] = json.loads(lines[-1])
        row = rows[variant]
        extra = "".join("\n" + line for line in out.stdout.splitlines() if not line.startswith("{"))
        reference = next(iter(rows.values()))["first_loss"]  # the first variant's (plain's, by default)
        agrees = "" if abs(row["first_loss"] - reference) <= 0.01 * abs(reference) else "   DIFFERS from the first"
        print(f"{variant:13s} {row['tokens_per_s']:>10,.0f} tokens/s   peak {row['peak_gib']:.1f} GiB   first loss "
              f"{row['first_loss']:.4f}{agrees}   steps {', '.join(f'{s:.3f}' for s in row['step_s'])} s{extra}",
              flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
