"""The trainer scores what the sampler sampled: routing replay (common/routing_replay.py) and the sampling mask
(modeling.within_sampling_support), each against a real vLLM engine and the trainer's own forward
(ModelWorker._logprobs, padded and packed) on tiny MoE models after a weight sync.

Routing replay: with the trainer's routers alone perturbed (the engine untouched), the trainer routes tokens
otherwise than vLLM did; without replay vllm/logprob_diff jumps, with replay it stays near rounding. The perturbation
is built so that nothing but the routing can explain the jump: two experts score alike (their router rows are equal,
synced to the engine), and the trainer alone breaks the tie by scaling one row by 1 + 1e-3, which moves the replayed
gate weights by ~1e-3 of the router's logits and nothing else. Mixtral in the default tier; Qwen3-MoE and Qwen2-MoE
(whose router feeds a shared expert beside the routed ones) in the extended tier; under peft's LoRA too.

Sampling mask: at --top_p 0.9 vLLM's log-probs are over the nucleus, renormalised; the trainer's are over the
whole vocabulary unless --keep_sampling_mask.
"""

import argparse
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from common import routing_replay
from common.args import UserError
from common.model_worker import ModelWorker
from tests.try_model_families import FAMILIES, InProcessEngine, write_model

# Renormalised top-k gate weights, as Mixtral always has them and Qwen3-30B-A3B's config asks.
FAMILY_SETTINGS = {"mixtral": {}, "qwen3_moe": {"norm_topk_prob": True}, "qwen2_moe": {"norm_topk_prob": True}}
PERTURBATION = 1e-3
PROMPTS = [[5, 17, 40, 33, 8], [9, 10, 11], [60, 61, 62, 63, 64, 65, 66], [3, 90]]
TOP_P = 0.9


def trainer_logprobs(model, batch: dict, replay: bool = False, packing: bool = False, top_p: float = 1.0,
                     keep_sampling_mask: bool = False) -> tuple[torch.Tensor, float]:
    """The actor's log-probs of the batch through ModelWorker._logprobs, and moe/route_mismatch of that pass."""
    worker = ModelWorker.__new__(ModelWorker)  # the rank's forward alone: no Ray, no DeepSpeed
    worker.engine = model
    worker.args = argparse.Namespace(packing_samples=packing, share_prompts=False, temperature=1.0,
                                     routing_replay=replay, entropy_coef=0, top_p=top_p,
                                     keep_sampling_mask=keep_sampling_mask)
    with torch.no_grad():
        logprobs = worker._logprobs(batch)
    if worker.replay:
        worker.replay.remove()  # the next worker on this model hooks it anew
    return logprobs, worker.take_route_mismatch().get("moe/route_mismatch", float("nan"))


def logprob_diff(logprobs: torch.Tensor, batch: dict) -> float:
    """vllm/logprob_diff: mean |vLLM's log-prob - the trainer's| over the sampled tokens."""
    mask = batch["action_mask"].bool()
    return (logprobs - batch["vllm_logprobs"])[mask].abs().mean().item()


def sampled(family: str, out: str) -> dict:
    """An engine on the family's tiny model (experts 0 and 1 tied in every router) takes the trainer's weights by a
    sync, so that the capture must survive a reload, and samples the prompts at top_p 1 and TOP_P with
    ppo_ray.py's engine settings; returns the trainer's model and build_batch's batches."""
    import ray

    import ppo_ray
    from common.vllm_engine import VLLMEngine
    from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group, iter_gathered_params

    os.environ.update(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = write_model(family, os.path.join(out, family), **FAMILY_SETTINGS[family])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a training step's worth of change, which the sync carries to the engine
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
        for router in routing_replay.trainer_routers(model):  # experts 0 and 1 score alike: a tie rounding decides
            router.weight[1] = router.weight[0]
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # the weight sync's calls go through Ray
    try:
        engine = VLLMEngine(path, seed=0, max_model_len=128, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                            enforce_eager=True, dtype=None, enable_sleep_mode=False, use_gpu=False,
                            bundle_indices=None, llm_kwargs={"logprobs_mode": "processed_logprobs",
                                                             **routing_replay.engine_kwargs()})
        broadcast_weights_to_vllm(iter_gathered_params(model), [InProcessEngine(engine)],
                                  init_weight_sync_group([InProcessEngine(engine)]))
        seeds = list(range(len(PROMPTS)))
        full = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=12, seeds=seeds)
        nucleus = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=TOP_P, max_tokens=12, seeds=seeds)
        engine.shutdown()
    finally:
        ray.shutdown()
    fed = sum(len(s["token_ids"]) + len(p) - 1 for p, group in zip(PROMPTS, full) for s in group)
    return {"model": model, "batch": ppo_ray.build_batch(PROMPTS, full, pad_id=0), "fed": fed,
            "top_p_batch": ppo_ray.build_batch(PROMPTS, nucleus, pad_id=0)}


@pytest.fixture(scope="module")
def mixtral_samples(tmp_path_factory) -> dict:
    return sampled("mixtral", str(tmp_path_factory.mktemp("replay")))


def check_replay(run: dict) -> None:
    model, batch = run["model"], run["batch"]
    assert (batch["routes"][..., 0, 0] >= 0).sum().item() == run["fed"], "every token vLLM computed has its route"
    figures = {}
    for packing in (False, True):
        logprobs, mismatch = trainer_logprobs(model, batch, packing=packing)
        figures[f"synced packing={packing}"] = (logprob_diff(logprobs, batch), mismatch)
    with torch.no_grad():  # the trainer's routers alone break the tie: expert 1 wins where the score is positive
        routers = routing_replay.trainer_routers(model)
        for router in routers:
            router.weight[1] *= 1 + PERTURBATION
    try:
        for replay in (False, True):
            for packing in (False, True):
                logprobs, mismatch = trainer_logprobs(model, batch, replay, packing)
                figures[f"perturbed replay={replay} packing={packing}"] = (logprob_diff(logprobs, batch), mismatch)
        # under peft's LoRA (all-linear, as --lora_rank adapts; its adapters start at 0) the routers are found and
        # replayed alike
        adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for replay in (False, True):
            logprobs, mismatch = trainer_logprobs(adapted, batch, replay)
            figures[f"perturbed replay={replay} lora"] = (logprob_diff(logprobs, batch), mismatch)
        model = adapted.unload()
    finally:
        with torch.no_grad():
            for router in routers:
                router.weight[1] /= 1 + PERTURBATION
    print(figures)  # (vllm/logprob_diff, moe/route_mismatch) each
    for case in ("packing=False", "packing=True", "lora"):
        if case != "lora":
            diff, mismatch = figures[f"synced {case}"]
            assert diff < 1e-4 and mismatch < 0.02, "the same weights route alike and score to rounding"
        without, without_mismatch = figures[f"perturbed replay=False {case}"]
        replayed, replayed_mismatch = figures[f"perturbed replay=True {case}"]
        # the perturbed routers choose otherwise, whether the forward then follows vLLM's choice or not
        assert without_mismatch > 0.1 and replayed_mismatch > 0.1
        # the flipped tokens went through another expert; the replayed ones through vLLM's, whose gate weights
        # moved by the perturbation alone (measured on Mixtral: 2.1e-2 against 9.0e-6)
        assert without > 1e-3 and replayed < 1e-4, figures


@pytest.mark.slow
def test_routing_replay_scores_the_experts_vllm_used_on_mixtral(mixtral_samples):
    check_replay(mixtral_samples)


@pytest.mark.slow
def test_the_sampling_mask_scores_the_support_vllm_sampled_from(mixtral_samples):
    """At top_p 0.9 (experts replayed, so that routing plays no part) vLLM's log-probs are the nucleus's; the
    trainer's over the whole vocabulary lie below them by the nucleus's missing mass."""
    model, batch = mixtral_samples["model"], mixtral_samples["top_p_batch"]
    figures = {}
    for keep in (False, True):
        for packing in (False, True):
            logprobs, _ = trainer_logprobs(model, batch, True, packing, TOP_P, keep)
            figures[f"keep_sampling_mask={keep} packing={packing}"] = logprob_diff(logprobs, batch)
    print(figures)
    for packing in (False, True):
        assert figures[f"keep_sampling_mask=False packing={packing}"] > 1e-2, figures
        assert figures[f"keep_sampling_mask=True packing={packing}"] < 1e-4, figures


@pytest.mark.extended
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_routing_replay_on_other_families(family, tmp_path):
    check_replay(sampled(family, str(tmp_path)))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_each_router_kind_hands_its_block_the_given_experts_at_its_own_weights(family):
    """Without an engine: routes drawn at random are what every router hands its experts' block under replay, with
    the weights its own probabilities give them (DeepSeek-V3's grouped, biased sigmoid choice and gpt-oss's top-k of
    logits among them); moe/route_mismatch counts the decisions that differ from the router's own."""
    from common.tiny_model import build_tokenizer
    from tests.model_family_table import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, build_tokenizer())).float().eval()
    routers = routing_replay.trainer_routers(model)
    assert routers, f"no router of {family} found"
    ids = torch.randint(3, 300, (2, 9))
    tokens, k, experts = ids.numel(), routers[0].top_k, routers[0].num_experts
    routes = torch.stack([torch.stack([torch.randperm(experts)[:k] for _ in routers]) for _ in range(tokens)])
    routes = routes.to(torch.int16)  # (tokens, MoE layers, k)
    handed, own = [], []
    hooks = [r.register_forward_hook(lambda m, a, out: handed.append(out)) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=ids)
            own, handed = handed, []
            with routing_replay.replaying(model, routes, force=True) as counts:
                model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    for layer, (_, _, indices) in enumerate(handed):
        assert (indices == routes[:, layer].long()).all()
    # the first router sees the same input with and without replay: where the given experts are its own choice, it
    # weighs them as it did; elsewhere by its own probabilities of the given ones (not its choice's)
    (_, weights, indices), (_, own_weights, own_indices) = handed[0], own[0]
    same = (indices.sort(-1).values == own_indices.sort(-1).values).all(-1)  # (tokens,)
    assert same.any() and not same.all()
    torch.testing.assert_close(weights[same].sort(-1).values, own_weights[same].sort(-1).values)
    # every decision compared; the first layer's differences as counted without replay, the later layers' from
    # inputs the replay changed
    first = int((~same).sum())
    assert counts[1] == tokens * len(routers) and first <= counts[0] <= counts[1] - int(same.sum())


def test_a_checkpointed_backward_routes_its_recomputation_as_the_forward(tmp_path):
    """--gradient_checkpointing recomputes each layer in the backward pass, after the forward has returned: the
    replayed experts must hold there too, or the gradient is taken through other experts than the loss used. The
    router's gradient through ModelWorker._logprobs equals the unchecked forward's, and differs from the router's
    own routing's."""
    path = write_model("mixtral", str(tmp_path / "mixtral"))
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (2, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(9).expand(2, 9),
             "action_mask": torch.ones(2, 8)}
    batch["routes"] = torch.stack([torch.randperm(4)[:2] for _ in range(2 * 9 * 2)]).view(2, 9, 2, 2).to(torch.int16)

    def router_gradients(checkpointing: bool, replay: bool) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        worker = ModelWorker.__new__(ModelWorker)
        worker.engine = model
        worker.args = argparse.Namespace(packing_samples=False, share_prompts=False, temperature=1.0,
                                         routing_replay=replay, entropy_coef=0, keep_sampling_mask=False)
        worker._logprobs(batch).sum().backward()
        return torch.cat([r.weight.grad.flatten() for r in routing_replay.trainer_routers(model)])

    replayed = router_gradients(False, True)
    torch.testing.assert_close(router_gradients(True, True), replayed)
    assert not torch.allclose(router_gradients(False, False), replayed)


def test_replay_is_refused_where_it_cannot_apply(tiny_model, tmp_path):
    mixtral = write_model("mixtral", str(tmp_path / "mixtral"))
    args = argparse.Namespace(routing_replay=True, pretrain=tiny_model, gradient_checkpointing=False, ptx_data=None)
    with pytest.raises(UserError, match="dense model"):
        routing_replay.check_flags(args)
    jamba = str(tmp_path / "jamba")  # experts behind a plain nn.Linear router, which the replay cannot force
    AutoConfig.for_model("jamba", **FAMILIES["jamba"]).save_pretrained(jamba)
    with pytest.raises(UserError, match="routes without one"):
        routing_replay.check_flags(argparse.Namespace(**{**vars(args), "pretrain": jamba}))
    args.pretrain = mixtral
    routing_replay.check_flags(args)
    args.gradient_checkpointing = True
    routing_replay.check_flags(args)
    args.ptx_data = "text.jsonl"
    with pytest.raises(UserError, match="--gradient_checkpointing and --ptx_data"):
        routing_replay.check_flags(args)
