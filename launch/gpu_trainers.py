"""The trainers on one GPU, checked against what the project predicts: `make gpu-trainers`, in a few minutes on an H100.

For a GPU node that has torch but no vLLM or Ray (see launch/wheelhouse.py for the offline install), this runs
everything but ppo_ray.py on a ~0.9B-parameter Llama built from its config with random weights (no hub):

    trainers    sft.py, rm.py, dpo.py, kto.py in bf16 under the deepspeed launcher, ZeRO-3 and ZeRO-2, a few steps
                each (a few at a time), and sft.py with LoRA; every saved model loaded back with plain transformers
                and compared with the base (same parameters, every one finite, some changed)
    memory      each run's peak (torch.cuda.max_memory_allocated, logged as perf/gpu_peak_memory_gib) against what
                common/memory_plan.py predicts for that model and layout, per role
    ipc         the CUDA IPC bucket transport of common/weight_sync.py between two processes on the GPU: the trainer
                packs buckets and sends their handles, a receiver copies each one out and splits it as the vLLM
                worker does; every tensor compared bit for bit with the saved weights, and the seconds per GB
    throughput  sft.py at sequences of 2048, micro-batch 4, as it runs by default and with --torch_compile: tokens/s
                and MFU, beside a plain transformers + torch AdamW loop on the same GPU, model and shape

    python launch/gpu_trainers.py --out out/gpu_trainers                    # the ~0.9B model, on a GPU
    python launch/gpu_trainers.py --out /tmp/g --size tiny --stages trainers  # the same code on CPU, a tiny model

Every result goes to the console and to <out>/results.json; a failed run prints its log's end and its command.
"""

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from common import memory_plan  # noqa: E402
from common.synthetic_task import tokenizer_corpus, write_task  # noqa: E402
from common.tiny_model import build_tokenizer  # noqa: E402

SIZES = {  # a Llama-2-style ~0.9B (grouped-query attention, untied head, 32k vocabulary) and a CPU-sized stand-in
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM
STEPS, BATCH, MICRO, MAX_LEN = 3, 16, 8, 128  # the trainer runs: a few steps on the synthetic task
LONG_LEN, LONG_MICRO, LONG_BATCH, LONG_STEPS = 2048, 4, 16, 8  # the throughput runs
# A run on the GPU takes under a minute; one that hangs (a rendezvous, say) is cut off rather than eat the rest.
RUN_TIMEOUT = 200 if torch.cuda.is_available() else 600


def write_base(out: str, size: str) -> str:
    """The random-weight Llama (bf16 on a GPU) with the project's tokenizer, saved as a model from the hub would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(out, f"base-{size}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer()
    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    if torch.cuda.is_available():
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_long_texts(path: str, n: int, tokens: int) -> str:
    """n texts of at least `tokens` tokens each ({"text"}), for sft.py --pretrain_mode at full length."""
    tokenizer = build_tokenizer()
    corpus = tokenizer_corpus()
    per_line = max(1, len(tokenizer(" ".join(corpus[:50]))["input_ids"]) // 50)
    lines_needed = 2 * tokens // per_line + 1
    with open(path, "w") as f:
        for i in range(n):
            start = (i * 97) % len(corpus)
            text = " ".join((corpus * (lines_needed // len(corpus) + 2))[start:start + lines_needed])
            f.write(json.dumps({"text": text}) + "\n")
    return path


def trainer_runs(base: str, task: dict) -> list[dict]:
    """Each run: its script, ZeRO stage, extra flags, and the roles the memory plan gives it."""
    runs = []
    for stage in (3, 2):
        for script, data in (("sft", "sft_train"), ("rm", "pref_train"), ("dpo", "pref_train"), ("kto", "kto_train")):
            runs.append({"name": f"{script}_z{stage}", "script": script, "stage": stage, "data": task[data],
                         "flags": []})
    runs.append({"name": "sft_lora_z2", "script": "sft", "stage": 2, "data": task["sft_train"],
                 "flags": ["--lora_rank", "16", "--lora_alpha", "32"]})
    return runs


def command(run: dict, base: str, out: str, port: int, launcher: list[str]) -> list[str]:
    return [*launcher, "--master_port", str(port), os.path.join(ROOT, run["script"] + ".py"), "--pretrain", base,
            "--dataset", run["data"], "--apply_chat_template", "--max_len", str(MAX_LEN), "--train_batch_size",
            str(BATCH), "--micro_train_batch_size", str(MICRO), "--max_steps", str(STEPS), "--zero_stage",
            str(run["stage"]), "--output_dir", os.path.join(out, run["name"]), "--save_steps", "0", *run["flags"]]


def launch(name: str, cmd: list[str], out: str, timeout: int) -> dict:
    """Run a trainer command; its log goes to <out>/<name>.log. Returns its metrics (the last line's) and time."""
    log = os.path.join(out, name + ".log")
    start = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"rc": rc, "seconds": round(time.time() - start, 1)}
    metrics_file = os.path.join(out, name, "metrics.jsonl")
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            result["metrics"] = [json.loads(line) for line in f]
    if rc != 0:
        with open(log) as f:
            result["log_tail"] = f.read()[-3000:]
        result["command"] = shlex.join(cmd)
    return result


def check_saved(path: str, base: str, script: str) -> str:
    """Load the saved model with plain transformers and compare it with the base: '' if sound, else what is wrong."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model_class = AutoModelForSequenceClassification if script == "rm" else AutoModelForCausalLM
    model = model_class.from_pretrained(path, dtype=torch.float32, **({"num_labels": 1} if script == "rm" else {}))
    base_weights = {}
    for file in sorted(f for f in os.listdir(base) if f.endswith(".safetensors")):
        base_weights.update(load_file(os.path.join(base, file)))
    params = dict(model.named_parameters())
    if not all(torch.isfinite(p).all() for p in params.values()):
        return "a saved weight is not finite"
    shared = [n for n in params if n in base_weights]
    if len(shared) < len(base_weights) - 1:  # the reward model has a score head in place of lm_head
        return f"{len(base_weights) - len(shared)} of the base's tensors are missing from the saved model"
    changed = sum(not torch.equal(params[n].float(), base_weights[n].float()) for n in shared)
    return "" if changed else "no weight changed from the base"


def predicted_gib(run: dict, base: str, lora_rank: int) -> dict:
    """What common/memory_plan.py puts on the GPU for this run, by role (GiB): the trained model (the plan's actor
    or critic, with the vocabulary forward's logits for a causal LM) and, for dpo/kto, the frozen reference."""
    config = memory_plan.read_config(base, "--pretrain")
    scalar_head = run["script"] == "rm"
    sizes = memory_plan.model_sizes(config, scalar_head=scalar_head)
    args = types.SimpleNamespace(zero_stage=run["stage"], offload_optimizer=False, load_in_4bit=False,
                                 gradient_checkpointing=False, lora_rank=lora_rank)
    pairs = 2 if run["script"] in ("dpo", "kto") else 1  # chosen and rejected, or samples and mismatched pairs
    tokens = pairs * MICRO * MAX_LEN
    roles = {"trained": memory_plan.trained(args, sizes, 1, tokens)}
    if not scalar_head:
        roles["trained"]["logits"] = tokens * sizes["vocab"] * memory_plan.LOGIT_BYTES
    if run["script"] in ("dpo", "kto") and not lora_rank:
        roles["reference"] = {**memory_plan.frozen(sizes["params"], sizes["largest_layer"], 1, False),
                              "logits": tokens * sizes["vocab"] * memory_plan.LOGIT_BYTES}
    return {role: memory_plan.gpu_bytes(need) / memory_plan.GiB for role, need in roles.items()}


def stage_trainers(base: str, out: str, task: dict, parallel: int, launcher: list[str]) -> dict:
    results = {}
    runs = trainer_runs(base, task)

    def one(i_run):
        i, run = i_run
        result = launch(run["name"], command(run, base, out, 29600 + i, launcher), out, RUN_TIMEOUT)
        if result["rc"] == 0:
            result["saved"] = check_saved(os.path.join(out, run["name"]), base, run["script"]) or "ok"
            lora = 16 if "--lora_rank" in run["flags"] else 0
            result["predicted_gib"] = predicted_gib(run, base, lora)
            peaks = [m["perf/gpu_peak_memory_gib"] for m in result.get("metrics", [])
                     if "perf/gpu_peak_memory_gib" in m]
            result["peak_gib"] = max(peaks) if peaks else None
        return run["name"], result

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for name, result in pool.map(one, enumerate(runs)):
            results[name] = result
            report_trainer(name, result)
    return results


def report_trainer(name: str, result: dict) -> None:
    if result["rc"] != 0:
        print(f"{name:12s} FAILED (rc {result['rc']}, {result['seconds']} s): {result['command']}\n"
              f"{result['log_tail']}", flush=True)
        return
    losses = [m.get("train/loss") for m in result.get("metrics", []) if "train/loss" in m]
    loss = " -> ".join(f"{v:.3f}" for v in losses[:1] + losses[-1:]) if losses else "-"
    predicted = result["predicted_gib"]
    total = sum(predicted.values())
    peak = result["peak_gib"]
    memory = (f"peak {peak:.2f} GiB, plan {total:.2f} GiB ({' + '.join(f'{r} {v:.2f}' for r, v in predicted.items())})"
              f", peak/plan {peak / total:.2f}" if peak else f"plan {total:.2f} GiB (no GPU peak logged)")
    print(f"{name:12s} ok in {result['seconds']:5.1f} s   loss {loss}   saved model: {result['saved']}   {memory}",
          flush=True)


# ------------------------------------------------------------------------------------------------ CUDA IPC transport
def ipc_receiver(conn, expected_files: list[str]) -> None:
    """The vLLM worker's half, in a process of its own: copy each bucket out of the trainer's memory and split it,
    as WeightSyncWorkerExtension.weight_sync_receive_bucket does; then compare everything with the saved weights."""
    from safetensors.torch import load_file

    from common.weight_sync import copy_ipc_bucket, split_bucket

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    received = {}
    while (message := conn.recv()) is not None:
        meta, handle = message
        if meta == "sync":
            received = {}
            conn.send("ok")
            continue
        flat = copy_ipc_bucket(handle, device)
        received.update(split_bucket(flat, meta))
        conn.send("ok")
    expected = {name: t for file in expected_files for name, t in load_file(file, device="cuda:0").items()}
    differ = [name for name, t in expected.items() if name not in received or not torch.equal(received[name], t)]
    conn.send({"tensors": len(received), "expected": len(expected), "differ": differ[:5], "n_differ": len(differ)})


def stage_ipc(base: str) -> dict:
    """Two syncs of the base model over CUDA IPC into a receiver process; the second is the steady state."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from common.weight_sync import WeightSyncGroup, ipc_handle, iter_gathered_params, pack_buckets

    files = [os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors")]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda()
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    receiver = ctx.Process(target=ipc_receiver, args=(theirs, files))
    receiver.start()
    syncs = []
    for _ in range(2):
        ours.send(("sync", None))
        ours.recv()
        torch.cuda.synchronize()
        start, sent, buckets = time.perf_counter(), 0, 0
        for flat, meta in pack_buckets(iter_gathered_params(model), WeightSyncGroup(None, "ipc"), 256 * 2**20):
            ours.send((meta, ipc_handle(flat)))
            ours.recv()  # the receiver has copied it: the buffer may be reused
            sent += flat.numel() * flat.element_size()
            buckets += 1
        seconds = time.perf_counter() - start
        torch.cuda.ipc_collect()
        syncs.append({"GB": sent / 1e9, "buckets": buckets, "seconds": seconds, "s_per_GB": seconds / (sent / 1e9)})
    ours.send(None)
    check = ours.recv()
    receiver.join(60)
    # what a plain device-to-device copy of the same bytes costs, for scale
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.cuda.synchronize()
    start = time.perf_counter()
    flat.clone()
    torch.cuda.synchronize()
    copy_s_per_gb = (time.perf_counter() - start) / (flat.numel() * 2 / 1e9)
    del model, flat
    torch.cuda.empty_cache()  # the trainer runs that follow share this GPU
    result = {"syncs": syncs, **check, "device_copy_s_per_GB": copy_s_per_gb}
    ok = check["n_differ"] == 0 and check["tensors"] == check["expected"]
    print(f"ipc          {'ok' if ok else 'FAILED'}: {check['tensors']} tensors received of {check['expected']}, "
          f"{check['n_differ']} differ from the saved weights {check['differ']}; "
          + "; ".join(f"sync {i + 1}: {s['GB']:.2f} GB in {s['buckets']} buckets, {s['seconds']:.3f} s "
                      f"({s['s_per_GB']:.3f} s/GB)" for i, s in enumerate(syncs))
          + f"; a device copy of the same bytes: {copy_s_per_gb:.4f} s/GB", flush=True)
    return result


# -------------------------------------------------------------------------------------------------------- throughput
def flops_per_token(base: str, seq: int) -> float:
    """6 x the matmul parameters (all but the input embedding) + causal attention's 6 x layers x seq x hidden."""
    config = memory_plan.read_config(base, "--pretrain")
    sizes = memory_plan.model_sizes(config)
    matmul = sizes["params"] - config.vocab_size * config.hidden_size
    return 6 * matmul + 6 * config.num_hidden_layers * seq * config.hidden_size


def plain_loop(base: str, data: str, steps: int) -> float:
    """Tokens/s of plain transformers + torch AdamW (fused) on the same model and shapes: bf16 weights, sdpa
    attention, the same micro-batches and gradient accumulation, the steps after the first timed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    with open(data) as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = torch.tensor([tokenizer(t)["input_ids"][:LONG_LEN] for t in texts[:LONG_BATCH]], device="cuda")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    accumulation = LONG_BATCH // LONG_MICRO
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for micro in ids.split(LONG_MICRO):
            loss = model(input_ids=micro, labels=micro).loss / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return ids.numel() / (sum(times[1:]) / len(times[1:]))


def stage_throughput(base: str, out: str, launcher: list[str]) -> dict:
    """sft.py as it runs by default and with --torch_compile, beside the plain loop."""
    data = write_long_texts(os.path.join(out, "long.jsonl"), LONG_BATCH * LONG_STEPS, LONG_LEN)
    per_token = flops_per_token(base, LONG_LEN)
    mfu = lambda rate: rate * per_token / H100_BF16_FLOPS  # noqa: E731
    plain = plain_loop(base, data, LONG_STEPS) if torch.cuda.is_available() else float("nan")
    results = {"plain_tokens_per_s": plain, "plain_mfu": mfu(plain), "flops_per_token": per_token}
    for name, extra in (("sft", []), ("sft_compiled", ["--torch_compile"])):
        cmd = [*launcher, "--master_port", "29650", os.path.join(ROOT, "sft.py"), "--pretrain", base, "--dataset",
               data, "--pretrain_mode", "--input_key", "text", "--max_len", str(LONG_LEN), "--train_batch_size",
               str(LONG_BATCH), "--micro_train_batch_size", str(LONG_MICRO), "--max_steps", str(LONG_STEPS),
               "--output_dir", os.path.join(out, f"throughput_{name}"), "--save_steps", "0", *extra]
        result = launch(f"throughput_{name}", cmd, out, RUN_TIMEOUT)
        results[name] = result
        if result["rc"] != 0:
            print(f"throughput   {name} FAILED (rc {result['rc']}): {result['command']}\n{result['log_tail']}",
                  flush=True)
            continue
        rates = [m["perf/tokens_per_sec"] for m in result["metrics"] if "perf/tokens_per_sec" in m][1:]
        ours = sum(rates) / len(rates)  # the first step (and with --torch_compile, its compilation) left out
        result.update(tokens_per_s=ours, mfu=mfu(ours), peak_gib=max(m.get("perf/gpu_peak_memory_gib", 0)
                                                                     for m in result["metrics"]))
        print(f"throughput   {' '.join(['sft.py', *extra])}: {ours:,.0f} tokens/s (MFU {mfu(ours):.1%}), plain "
              f"transformers + AdamW {plain:,.0f} tokens/s (MFU {mfu(plain):.1%}): {ours / plain:.0%} of the plain "
              f"loop; seq {LONG_LEN}, micro-batch {LONG_MICRO}, batch {LONG_BATCH}, peak {result['peak_gib']:.1f} "
              f"GiB (MFU against {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s, {per_token / 1e9:.2f} GFLOP/token)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gpu_trainers")
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--stages", default="ipc,trainers,throughput", help="comma-separated, in this order")
    parser.add_argument("--parallel", type=int, default=3 if torch.cuda.is_available() else 1,
                        help="trainer runs at a time (each is one process on the GPU)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stages = args.stages.split(",")
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1"]  # `deepspeed --num_gpus 1`
    start = time.time()
    base = write_base(args.out, args.size)
    task = write_task(os.path.join(args.out, "task"), n_train=400, n_eval=20)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU)"
    print(f"{gpu}, torch {torch.__version__}; base model {base} ready in {time.time() - start:.0f} s", flush=True)
    results_file = os.path.join(args.out, "results.json")
    results = {}
    if os.path.exists(results_file):
        with open(results_file) as f:
            results = json.load(f)
    for stage in stages:
        if stage == "trainers":
            results["trainers"] = stage_trainers(base, args.out, task, args.parallel, launcher)
        elif stage == "ipc":
            results["ipc"] = stage_ipc(base) if torch.cuda.is_available() else {"skipped": "no GPU"}
        elif stage == "throughput":
            results["throughput"] = stage_throughput(base, args.out, launcher)
        else:
            raise SystemExit(f"--stages: unknown stage {stage!r}; the stages are trainers, ipc, throughput.")
        with open(results_file, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"done in {time.time() - start:.0f} s; results in {results_file}", flush=True)


if __name__ == "__main__":
    main()
