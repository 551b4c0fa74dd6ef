"""The on-policy update (ppo_ray.update_is_on_policy) and the workers' share of the cores.

With one optimizer step per rollout and no KL penalty in the reward, the experience phase skips the actor's forward
pass and the update takes its own log-probs, detached, as the old ones. That must change nothing: the update and the
metrics the experience phase used to log (vllm/logprob_diff, objective/kl) come out as before.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

import ppo_ray
from common.args import exit_if_distributed
from common.net import free_port
from common.ray_workers import RayWorker


def grpo_args(**overrides) -> ppo_ray.Args:
    values = dict(advantage_estimator="grpo", rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8,
                  micro_train_batch_size=4, init_kl_coef=0.0)
    return ppo_ray.Args(**{**values, **overrides})


@pytest.mark.parametrize("overrides, on_policy", [
    ({}, True),
    ({"init_kl_coef": 0.01}, True),  # GRPO's KL is a loss term: computed in the update from its own log-probs
    ({"advantage_estimator": "reinforce++"}, True),
    ({"advantage_estimator": "gae", "init_kl_coef": 0.01}, False),  # the reward's KL penalty needs them first
    ({"train_batch_size": 4}, False),  # two optimizer steps: the second one's old log-probs are not its own
    ({"max_epochs": 2}, False),
    ({"async_rollouts": True}, False),  # sampled by the policy one update old
    ({"async_rollouts": True, "partial_rollouts": True}, False),  # some tokens are one version old (the default)
    ({"async_rollouts": True, "partial_rollouts": True, "max_staleness": 2}, False),
    ({"async_rollouts": True, "partial_rollouts": True, "max_staleness": 0}, True),  # every older token dropped
])
def test_when_the_update_is_on_policy(overrides, on_policy):
    assert ppo_ray.update_is_on_policy(grpo_args(**overrides)) is on_policy


def test_no_reference_at_kl_coefficient_zero():
    assert not ppo_ray.uses_reference(grpo_args())
    assert ppo_ray.uses_reference(grpo_args(init_kl_coef=0.01))


def test_a_worker_computes_with_its_share_of_the_cores():
    worker, before = RayWorker(), torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        worker.set_cpu_threads({"experience": 3, "train": 1})
        assert worker.threads() == {"experience": max(1, cores // 3), "train": cores}
        worker.use_cpu_threads("train")
        assert torch.get_num_threads() == cores
        worker.use_cpu_threads("experience")
        assert torch.get_num_threads() == max(1, cores // 3)
    finally:
        torch.set_num_threads(before)


def _actor_step(rank: int, port: int, path: str, on_policy: bool, out: str):
    """One rank: ppo_ray.ActorWorker takes one GRPO step of 2 micro-batches, with the old log-probs made by the
    experience phase's forward (as before) or by the update itself."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu")
    from common.deepspeed_utils import gathered_state_dict

    args = grpo_args(actor_learning_rate=1e-2, warmup_ratio=0.0, init_kl_coef=0.05, vllm_is_correction=True)
    worker = ppo_ray.ActorWorker()
    worker.setup(args, path, 10)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (8, 12), generator=g)
    mask = torch.ones(8, 11)
    mask[:, :4] = 0  # the prompt
    experience = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "position_ids": torch.arange(12).expand(8, 12), "action_mask": mask,
                  "advantages": torch.randn(8, 1, generator=g) * mask}
    logprobs = worker.logprobs(experience)
    experience["vllm_logprobs"] = (logprobs + 0.01 * torch.randn(8, 11, generator=g)) * mask
    experience["ref_logprobs"] = logprobs + 0.1 * torch.randn(8, 11, generator=g)
    metrics = {}
    if not on_policy:  # what make_experience does then
        experience["old_logprobs"] = logprobs
        metrics = ppo_ray.old_logprob_metrics(args, logprobs, experience, mask)
        experience["is_weights"], correction = ppo_ray.vllm_correction(args, logprobs, experience["vllm_logprobs"],
                                                                        mask)
        metrics.update(correction)
    metrics.update(worker.fit(experience, 0.05, 0))
    torch.save({"state": gathered_state_dict(worker.engine.module, 0), "metrics": metrics}, out)
    exit_if_distributed(0)  # as the scripts end a rank: the interpreter's own exit aborts now and then


@pytest.mark.slow
def test_the_on_policy_update_equals_the_update_from_the_experience_phases_logprobs(tiny_model, tmp_path):
    runs = {}
    for on_policy in (False, True):
        out = str(tmp_path / f"{on_policy}.pt")
        mp.spawn(_actor_step, args=(free_port(), tiny_model, on_policy, out), nprocs=1, join=True)
        runs[on_policy] = torch.load(out)
    for key in ("vllm/logprob_diff", "objective/kl", "vllm/is_capped", "loss/policy_avg", "policy/clipfrac_avg"):
        torch.testing.assert_close(torch.as_tensor(runs[True]["metrics"][key]),
                                   torch.as_tensor(runs[False]["metrics"][key]), atol=1e-6, rtol=1e-5, msg=key)
    assert runs[True]["metrics"]["vllm/logprob_diff"] > 1e-3  # the metric measured something
    for name, tensor in runs[False]["state"].items():
        torch.testing.assert_close(runs[True]["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
