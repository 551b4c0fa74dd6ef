"""Time a trainer -> vLLM weight sync against a raw gloo broadcast of the same bytes, for a few model sizes.

    .venv/bin/python bench/bench_weight_sync.py                        # tiny, 512x8 and 768x12 (~85M parameters)
    .venv/bin/python bench/bench_weight_sync.py --configs tiny --repeats 5
    .venv/bin/python bench/bench_weight_sync.py --shared_memory false      # over gloo

The sync (common/weight_sync.broadcast_weights_to_vllm) packs the HF model's parameters into buckets, hands them
to one vLLM engine (a Ray actor, CPU, float32) and loads them in place. The engine runs on this host, so it copies
each bucket out of the trainer's shared memory, as it does in a run; --shared_memory false sends the buckets over
gloo instead, as to an engine on another host. The baseline sends the same number of bytes from the same process to
a bare Ray actor in one gloo broadcast, with one Ray call, and loads nothing: the ratio is what packing, the
per-bucket Ray calls, the transport, splitting and vLLM's weight loading cost on top of that wire.
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.update(HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # Ray passes sys.path to actors

import ray
import torch
from transformers import AutoModelForCausalLM

from common.args import parse_args
from common.net import free_port
from common.tiny_model import write_tiny_model
from common.vllm_engine import create_vllm_engines, shutdown_engines
from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group, new_process_group

# name -> write_tiny_model keyword arguments (head_dim stays >= 32 for vLLM's CPU attention)
CONFIGS = {
    "tiny": {},
    "512x8": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4},
    "768x12": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4},
}


@dataclass
class Args:
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    """model sizes to time, from: tiny, 512x8, 768x12"""
    bucket_mb: int = 256
    """bucket size of the sync, in MiB"""
    repeats: int = 3
    """timed runs per measurement (after one untimed warm-up); the median is reported"""
    shared_memory: bool = True
    """the engine, on this host, copies the buckets out of shared memory as it does in a run; false: over gloo, as
    an engine on another host gets them"""


@ray.remote(num_cpus=0)
class GlooReceiver:
    """The baseline's other end: joins a two-rank gloo group and receives broadcasts into one buffer, kept from one
    receive to the next as the sync's workers keep theirs (a fresh one would add its first touch's page faults)."""

    def join(self, master_address: str, master_port: int) -> None:
        self.group = new_process_group(master_address, master_port, 1, 2, "gloo")
        self.buffer = torch.empty(0)

    def receive(self, numel: int) -> None:
        if self.buffer.numel() != numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)
        self.group.broadcast(self.buffer, 0).wait()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocations, lazy connection setup
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(name: str, args: Args, workdir: str) -> dict:
    path = write_tiny_model(os.path.join(workdir, name), seed=0, **CONFIGS[name])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = create_vllm_engines(1, 1, path, seed=0, max_model_len=256, enforce_eager=True, dtype="float32")
        group = init_weight_sync_group(engines, shared_memory=args.shared_memory)
        loads = []

        def sync():
            stats = broadcast_weights_to_vllm(model.named_parameters(), engines, group,
                                              bucket_bytes=args.bucket_mb * 2**20)
            loads.append(stats["weight_sync/load_seconds"])
            sync.stats = stats

        sync_s = median_seconds(sync, args.repeats)
        stats = sync.stats

        receiver = GlooReceiver.remote()
        address, port = "127.0.0.1", free_port()
        ref = receiver.join.remote(address, port)
        raw_group = new_process_group(address, port, 0, 2, "gloo")
        ray.get(ref)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (total numel,)

        def raw():
            ref = receiver.receive.remote(flat.numel())
            raw_group.broadcast(flat, 0).wait()
            ray.get(ref)

        raw_s = median_seconds(raw, args.repeats)
        shutdown_engines(engines)
    finally:
        ray.shutdown()
    return {"model": name, "params_m": flat.numel() / 1e6, "mib": stats["weight_sync/bytes"] / 2**20,
            "tensors": stats["weight_sync/tensors"], "buckets": stats["weight_sync/buckets"], "sync_s": sync_s,
            "load_s": statistics.median(loads[1:]), "raw_s": raw_s}


def main(args: Args):
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.configs:
            rows.append(bench_one(name, args, workdir))
    how = "shared memory" if args.shared_memory else "gloo"
    print(f"\nweight sync over {how} vs raw gloo broadcast (CPU, float32, bucket {args.bucket_mb} MiB, median of "
          f"{args.repeats})")
    print("('vLLM load': the part of the sync vLLM spends putting the tensors into its model, on CPU mostly repacking\n"
          " the linear layers for its GEMM kernels; 'ratio w/o load' leaves it out)")
    print(f"{'model':>8} {'params':>8} {'MiB':>8} {'tensors':>8} {'buckets':>8} {'sync s':>8} {'vLLM load':>9} "
          f"{'raw s':>8} {'ratio':>6} {'ratio w/o load':>14} {'sync GB/s':>9}")
    for r in rows:
        print(f"{r['model']:>8} {r['params_m']:>7.1f}M {r['mib']:>8.1f} {r['tensors']:>8} {r['buckets']:>8} "
              f"{r['sync_s']:>8.3f} {r['load_s']:>9.3f} {r['raw_s']:>8.3f} {r['sync_s'] / r['raw_s']:>6.1f} "
              f"{(r['sync_s'] - r['load_s']) / r['raw_s']:>14.1f} {r['mib'] * 2**20 / r['sync_s'] / 1e9:>9.2f}")


if __name__ == "__main__":
    main(parse_args(Args))
