"""The sampler/trainer mismatch in float32 and bfloat16, and what routing replay and the sampling mask remove of it.

    .venv/bin/python bench/bench_sampler_mismatch.py                       # dense and MoE, fp32 and bf16, ~4 minutes
    .venv/bin/python bench/bench_sampler_mismatch.py --models mixtral --dtypes bfloat16

For each model (a tiny Llama, a tiny Mixtral; common/tiny_model.py and tests/try_model_families.py build them) and
precision, one vLLM engine samples GRPO-shaped rollouts (--prompts prompts x 4 responses of up to 32 tokens) as
ppo_ray.py's engines do (processed log-probs, seeded, prefix caching off for the routes), at top_p 1 and 0.9. The
trainer's forward (ModelWorker._logprobs, the code a run's actor uses) scores them in the same precision, on the
same checkpoint, with and without --routing_replay and --keep_sampling_mask. Reported per row: vllm/logprob_diff
(mean |log pi_vllm - log pi_trainer| over response tokens), moe/route_mismatch, and the share of tokens TIS caps
(ratio > 2) and IcePop masks (outside [0.5, 5]). The trainer computes in float32 on CPU in a run; bfloat16 here
stands for a GPU run, whose trainer and engines compute in it (on a CPU with AVX-512 BF16 vLLM runs it).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

os.environ.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                  TOKENIZERS_PARALLELISM="false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import ppo_ray  # noqa: E402
from common import routing_replay  # noqa: E402
from common.args import parse_args  # noqa: E402
from common.model_worker import ModelWorker  # noqa: E402
from common.synthetic_task import write_task  # noqa: E402
from common.tiny_model import write_tiny_model  # noqa: E402
from common.vllm_engine import VLLMEngine  # noqa: E402
from tests.try_model_families import write_model  # noqa: E402


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["llama", "mixtral"])
    """models to measure: llama (dense), mixtral (4 experts, 2 a token)"""
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    """precisions of the engine and the trainer alike"""
    prompts: int = 16
    """prompts of the synthetic task, 4 responses each"""


def trainer_logprobs(model, batch: dict, replay: bool, top_p: float, keep_sampling_mask: bool):
    """The actor's log-probs of the batch (ModelWorker._logprobs) and moe/route_mismatch of that pass."""
    worker = ModelWorker.__new__(ModelWorker)  # the rank's forward alone: no Ray, no DeepSpeed
    worker.engine = model
    worker.args = argparse.Namespace(packing_samples=False, temperature=1.0, routing_replay=replay, entropy_coef=0,
                                     top_p=top_p, keep_sampling_mask=keep_sampling_mask)
    with torch.no_grad():
        logprobs = worker._logprobs(batch)
    if worker.replay:
        worker.replay.remove()  # the next worker on this model hooks it anew
    return logprobs, worker.take_route_mismatch().get("moe/route_mismatch")


def row(batch: dict, logprobs: torch.Tensor, mismatch) -> dict:
    """The figures of one scoring: logprob_diff, route_mismatch and the IS corrections' shares."""
    mask = batch["action_mask"]
    diff = (logprobs - batch["vllm_logprobs"])[mask.bool()].abs().mean().item()
    _, capped = ppo_ray.rollout_correction("tis", logprobs, batch["vllm_logprobs"], mask, 0.5, 2.0, (0.999, 1.001))
    _, masked = ppo_ray.rollout_correction("icepop", logprobs, batch["vllm_logprobs"], mask, 0.5, 5.0,
                                           (0.999, 1.001))
    return {"logprob_diff": diff, "route_mismatch": mismatch, "tis_capped": float(capped),
            "icepop_masked": float(masked)}


def measure(name: str, path: str, dtype: str, prompts: list[list[int]]) -> list[tuple[str, dict]]:
    engine = VLLMEngine(path, seed=0, max_model_len=256, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                        enforce_eager=True, dtype=dtype, enable_sleep_mode=False, use_gpu=False, bundle_indices=None,
                        llm_kwargs={"logprobs_mode": "processed_logprobs", **routing_replay.engine_kwargs()})
    engine.warm_up()
    seeds = list(range(len(prompts)))
    samples = {top_p: engine.generate(prompts, n=4, temperature=1.0, top_p=top_p, max_tokens=32, seeds=seeds)
               for top_p in (1.0, 0.9)}
    engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    moe = bool(routing_replay.trainer_routers(model))
    rows = []
    for top_p, drawn in samples.items():
        batch = ppo_ray.build_batch(prompts, drawn, pad_id=0)
        for replay in (False, True) if moe else (False,):
            for keep in (False, True) if top_p < 1 else (False,):
                logprobs, mismatch = trainer_logprobs(model, batch, replay, top_p, keep)
                what = f"{name:8} {dtype:9} top_p {top_p:<4} replay {replay!s:5} mask {keep!s:5}"
                rows.append((what, row(batch, logprobs, mismatch)))
    return rows


def main(args: Args):
    out = tempfile.mkdtemp(prefix="bench_mismatch_")
    paths = {"llama": lambda: write_tiny_model(os.path.join(out, "llama"), seed=0),
             "mixtral": lambda: write_model("mixtral", os.path.join(out, "mixtral"))}
    task = write_task(os.path.join(out, "task"), seed=0)
    print(f"{'model, precision, flags':55} logprob_diff route_mismatch tis_capped icepop_masked")
    for name in args.models:
        path = paths[name]()
        tokenizer = AutoTokenizer.from_pretrained(path)
        with open(task["prompts_train"]) as f:
            prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in f][: args.prompts]
        for dtype in args.dtypes:
            start = time.perf_counter()
            for what, figures in measure(name, path, dtype, prompts):
                mismatch = "-" if figures["route_mismatch"] is None else f"{figures['route_mismatch']:.4f}"
                print(f"{what:55} {figures['logprob_diff']:12.2e} {mismatch:>14} {figures['tis_capped']:10.4f} "
                      f"{figures['icepop_masked']:13.4f}", flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main(parse_args(Args))
