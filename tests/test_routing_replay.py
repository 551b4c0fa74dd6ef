"""Routing replay (common/routing_replay.py): the experts vLLM routed each token to, captured in the engine, travel
with the batch, and the trainer's MoE layers use them.

The proof drives a real vLLM engine and the trainer's own forward (ModelWorker._logprobs, padded and packed) on tiny
MoE models, after a weight sync: with the trainer's routers alone perturbed (the engine untouched), the trainer
routes tokens otherwise than vLLM did; without replay vllm/logprob_diff jumps, with replay it stays near rounding.
The perturbation is built so that nothing but the routing can explain the jump: two experts score alike (their
router rows are equal, synced to the engine), and the trainer alone breaks the tie by scaling one row by 1 + 1e-3,
which moves the replayed gate weights by ~1e-3 of the router's logits and nothing else. Mixtral in the default tier; Qwen3-MoE and Qwen2-MoE (a family whose router feeds
a shared expert beside the routed ones) in the extended tier.
"""

import argparse
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import routing_replay
from common.args import UserError
from common.model_worker import ModelWorker
from tests.try_model_families import InProcessEngine, write_model

# Renormalised top-k gate weights, as Mixtral always has them and Qwen3-30B-A3B's config asks.
FAMILY_SETTINGS = {"mixtral": {}, "qwen3_moe": {"norm_topk_prob": True}, "qwen2_moe": {"norm_topk_prob": True}}
PERTURBATION = 1e-3
PROMPTS = [[5, 17, 40, 33, 8], [9, 10, 11], [60, 61, 62, 63, 64, 65, 66], [3, 90]]


def trainer_logprobs(model, batch: dict, replay: bool, packing: bool) -> tuple[torch.Tensor, float]:
    """The actor's log-probs of the batch through ModelWorker._logprobs, and moe/route_mismatch of that pass."""
    worker = ModelWorker.__new__(ModelWorker)  # the rank's forward alone: no Ray, no DeepSpeed
    worker.engine, worker.routes_from_vllm, worker.route_counts = model, True, [0, 0]
    worker.args = argparse.Namespace(packing_samples=packing, temperature=1.0, routing_replay=replay, entropy_coef=0)
    with torch.no_grad():
        logprobs = worker._logprobs(batch)
    return logprobs, worker.take_route_mismatch().get("moe/route_mismatch", float("nan"))


def logprob_diff(logprobs: torch.Tensor, batch: dict) -> float:
    mask = batch["action_mask"].bool()
    return (logprobs - batch["vllm_logprobs"])[mask].abs().mean().item()


def replay_check(family: str, out: str) -> dict:
    """An engine on the family's tiny model takes the trainer's weights by a sync (so that the capture survives a
    reload), samples, and the trainer scores the samples with and without its routers perturbed, with and without
    replay; returns the figures."""
    import ppo_ray
    from common.vllm_engine import VLLMEngine
    from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group, iter_gathered_params

    path = write_model(family, os.path.join(out, family), **FAMILY_SETTINGS[family])
    engine = VLLMEngine(path, seed=0, max_model_len=128, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                        enforce_eager=True, dtype=None, enable_sleep_mode=False, use_gpu=False, bundle_indices=None,
                        llm_kwargs=routing_replay.engine_kwargs())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    routers = routing_replay.trainer_routers(model)
    with torch.no_grad():  # a training step's worth of change, which the sync carries to the engine
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
        for router in routers:  # experts 0 and 1 score alike for every token: a tie that rounding decides
            router.weight[1] = router.weight[0]
    broadcast_weights_to_vllm(iter_gathered_params(model), [InProcessEngine(engine)],
                              init_weight_sync_group([InProcessEngine(engine)]))
    samples = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=12, seeds=list(range(len(PROMPTS))))
    engine.shutdown()
    batch = ppo_ray.build_batch(PROMPTS, samples, pad_id=0)
    result = {"layers": batch["routes"].shape[2],
              "known": (batch["routes"][..., 0, 0] >= 0).sum().item(),
              "fed": sum(len(s["token_ids"]) + len(p) - 1 for p, group in zip(PROMPTS, samples) for s in group)}
    for packing in (False, True):
        logprobs, result[f"mismatch_synced_packing{packing}"] = trainer_logprobs(model, batch, False, packing)
        result[f"diff_synced_packing{packing}"] = logprob_diff(logprobs, batch)
    with torch.no_grad():  # the trainer's routers alone break the tie: expert 1 wins where the score is positive
        for router in routers:
            router.weight[1] *= 1 + PERTURBATION
    for replay in (False, True):
        for packing in (False, True):
            logprobs, mismatch = trainer_logprobs(model, batch, replay, packing)
            result[f"diff_replay{replay}_packing{packing}"] = logprob_diff(logprobs, batch)
            result[f"mismatch_replay{replay}_packing{packing}"] = mismatch
    return result


def check_replay(family: str, out: str) -> None:
    import ray

    os.environ.update(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # the weight sync's calls go through Ray
    try:
        result = replay_check(family, out)
    finally:
        ray.shutdown()
    print(family, result)
    assert result["known"] == result["fed"], "every token vLLM computed has its route"
    for packing in (False, True):
        assert result[f"diff_synced_packing{packing}"] < 1e-4, "the same weights and experts: rounding"
        assert result[f"mismatch_synced_packing{packing}"] < 0.02, "the same weights route alike"
        # the perturbed routers choose otherwise, whether the forward then follows vLLM's choice or not
        assert result[f"mismatch_replayFalse_packing{packing}"] > 0.1
        assert result[f"mismatch_replayTrue_packing{packing}"] > 0.1
        # the flipped tokens went through another expert; the replayed ones through vLLM's, whose gate weights
        # moved by the perturbation alone (measured on Mixtral: 2.1e-2 against 9.0e-6)
        assert result[f"diff_replayFalse_packing{packing}"] > 1e-3
        assert result[f"diff_replayTrue_packing{packing}"] < 1e-4


@pytest.mark.slow
def test_routing_replay_scores_the_experts_vllm_used_on_mixtral(tmp_path):
    check_replay("mixtral", str(tmp_path))


@pytest.mark.extended
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_routing_replay_on_other_families(family, tmp_path):
    check_replay(family, str(tmp_path))


def test_replay_is_refused_where_it_cannot_apply(tiny_model, tmp_path):
    mixtral = write_model("mixtral", str(tmp_path / "mixtral"))
    args = argparse.Namespace(routing_replay=True, pretrain=tiny_model, gradient_checkpointing=False, env_fn=None)
    with pytest.raises(UserError, match="dense model"):
        routing_replay.check_flags(args)
    args.pretrain = mixtral
    routing_replay.check_flags(args)
    for flag, value in (("gradient_checkpointing", True), ("env_fn", "env.py:make_env")):
        with pytest.raises(UserError, match=f"--{flag}"):
            routing_replay.check_flags(argparse.Namespace(**{**vars(args), flag: value}))
