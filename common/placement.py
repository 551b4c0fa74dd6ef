"""Where ppo_ray.py's models run: Ray's start, each role's workers on placement groups (colocated as asked, checked
before anything is placed), the vLLM engines, and what connects them once placed (the weight-sync group, the cores
each phase gets, placement.json).

    driver (ppo_ray.py's main())
      |- vLLM engines (Ray actors)           generate rollouts, take new weights after every step
      |- actor    workers (DeepSpeed ranks)  old log-probs, the clipped policy update, weight sync to vLLM
      |- critic   workers                    values, the clipped value update            (gae only)
      |- reference workers                   log-probs of the frozen SFT model           (KL penalty)
      |- teacher   workers                   log-probs of a frozen teacher               (--teacher_pretrain)
      |- reward   workers, one group per RM  scores
"""

import functools
import json
import os
from dataclasses import dataclass, field

import ray
import torch

from common import lora, routing_replay
from common.args import UserError, stop_on_sigterm
from common.deepspeed_utils import mpi_launch
from common.model_worker import ModelWorker
from common.ppo_tricks import uses_reference
from common.ray_workers import (WorkerGroup, check_bundle_shares, check_resources, make_placement_group, share_cores,
                                use_gpus, wait)
from common.vllm_engine import COLOCATED_GPU_SHARE, SleepSchedule, create_vllm_engines, wait_for_engines
from common.weight_sync import SYNC_TIMEOUT


@dataclass
class Cluster:
    """What place_roles started: each role's worker group, and the vLLM engines with their sleep schedule."""
    actor: WorkerGroup | None = None
    ref: WorkerGroup | None = None
    teacher: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    rewards: list = field(default_factory=list)  # one group per reward model
    engines: list = field(default_factory=list)
    sleep: SleepSchedule | None = None

    def trained(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}

    def groups(self) -> dict:
        """Every role's worker group by name (the reward models' as `reward model i`)."""
        named = {"actor": self.actor, "ref": self.ref, "teacher": self.teacher, "critic": self.critic}
        return {**{k: g for k, g in named.items() if g}, **{f"reward model {i + 1}": g for i, g in
                                                            enumerate(self.rewards)}}


def start_ray(args, root: str) -> None:
    """Join --ray_address (or RAY_ADDRESS), else start a Ray of this run's own; workers import from `root`."""
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false"}
    # VLLM_BATCH_INVARIANT=1: a request's logits do not depend on the batch it shares (docs/equivalence.md)
    for key in ("HF_HUB_OFFLINE", "TORCH_EXTENSIONS_DIR", "VLLM_CPU_KVCACHE_SPACE", "VLLM_BATCH_INVARIANT",
                "WANDB_MODE"):
        if key in os.environ:
            env[key] = os.environ[key]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster needs no token
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        # On a machine without GPUs the roles share the cores: Ray's CPU count is a budget, not a pinning.
        num_cpus = None if torch.cuda.is_available() else max(os.cpu_count() or 1, 16)
        # "local": a Ray of this run's own, even when another Ray instance runs on this machine.
        ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": env}, include_dashboard=False,
                 log_to_driver=False)
    stop_on_sigterm()  # Ray's driver took SIGTERM over (it aborts); a stop should say what survives


# What the deepspeed launcher sets for a torch.distributed world of its own (deepspeed/launcher/launch.py).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def drives_the_run(script: str = "ppo_ray.py") -> bool:
    """`deepspeed ppo_ray.py` starts one process per GPU, but Ray places every worker itself: the process of RANK 0
    (or a plain `python`, which has no RANK) drives and forgets the launcher's world, which its Ray workers would
    inherit; the others exit with 0 (the launcher stops every process when one exits otherwise)."""
    rank = os.environ.get("RANK", str(mpi_launch()[1]))
    if rank != "0":
        print(f"{script}: launcher rank {rank} exits; the process of rank 0 drives the run, Ray starts the workers.")
        return False
    for key in LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    return True


def critic_path(args) -> str:
    """Where the critic starts: --critic_pretrain, else the first reward model, else the policy."""
    return args.critic_pretrain or (args.reward_pretrain[0] if args.reward_pretrain else args.pretrain)


def role_shares(args) -> dict[str, float]:
    """The share of its bundle (a GPU, or --cpus_per_worker CPUs) that each worker of a role asks Ray for."""
    share = 0.2 if args.colocate_all else (0.5 if args.colocate_actor_ref else 1.0)
    beside_critic = 0.5 if args.colocate_critic_reward else share
    return {"actor": share, "reference": share, "teacher": share, "critic": beside_critic,
            "reward model": beside_critic, "vLLM": COLOCATED_GPU_SHARE if args.colocate_all else 1.0}


def check_colocation(args, shares: dict[str, float]) -> None:
    """Refuse roles colocated on one bundle that ask for more than all of it: Ray would leave the last pending."""
    ref = {"reference": shares["reference"]} if uses_reference(args) and not args.lora_rank else {}
    ref.update({"teacher": shares["teacher"]} if args.teacher_pretrain else {})  # placed as the reference is
    critic = {"critic": shares["critic"]} if args.advantage_estimator == "gae" else {}
    rms = {f"reward model {i + 1}": shares["reward model"] for i in range(len(args.reward_pretrain or []))}
    if args.colocate_all:
        check_bundle_shares("actor", {"actor": shares["actor"], **ref, **critic, **rms, "vLLM": shares["vLLM"]})
        return
    if args.colocate_actor_ref:
        check_bundle_shares("actor", {"actor": shares["actor"], **ref})
    if args.colocate_critic_reward and critic:
        check_bundle_shares("critic", {**critic, **rms})


def place_roles(args, total_actor_steps: int, actor_cls, critic_cls) -> Cluster:
    """Start every role's workers and the vLLM engines on placement groups, colocated as asked."""
    use_critic = args.advantage_estimator == "gae"
    reward_paths = args.reward_pretrain or []
    cpus = args.cpus_per_worker
    gpu_layout = {"actor": args.actor_num_workers,
                  "reference": 0 if args.colocate_actor_ref or args.colocate_all or args.lora_rank
                  or not uses_reference(args) else args.ref_num_workers,
                  "teacher": 0 if args.colocate_actor_ref or args.colocate_all or not args.teacher_pretrain
                  else args.ref_num_workers,
                  "critic": args.critic_num_workers if use_critic and not args.colocate_all else 0,
                  "reward models": 0 if (args.colocate_critic_reward and use_critic) or args.colocate_all
                  else args.reward_num_workers * len(reward_paths),
                  "vLLM": 0 if args.colocate_all else args.vllm_num_engines * args.vllm_tensor_parallel_size}
    lora.check_args(args, gpu=use_gpus())
    check_resources({k: v * (1 if use_gpus() else cpus) for k, v in gpu_layout.items() if v})
    if args.colocate_all and args.vllm_num_engines * args.vllm_tensor_parallel_size != args.actor_num_workers:
        raise UserError("--colocate_all needs vllm_num_engines x vllm_tensor_parallel_size == actor_num_workers.")
    shares = role_shares(args)
    check_colocation(args, shares)

    shared = make_placement_group(args.actor_num_workers, cpus, "actor") if args.colocate_all else None
    # The engines first: PACK then keeps each tensor-parallel engine on one node, while whole nodes are free.
    engines = create_vllm_engines(
        args.vllm_num_engines, args.vllm_tensor_parallel_size, args.pretrain, args.seed,
        max_model_len=args.prompt_max_len + args.generate_max_len, placement_group=shared,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        enable_sleep_mode=args.colocate_all and use_gpus(), num_cpus_per_engine=cpus,
        # --routing_replay: CUDA graphs replay without running the routers' Python, which records the experts
        enforce_eager=not use_gpus() or args.routing_replay,
        dtype=None if args.vllm_dtype == "trainer" else args.vllm_dtype,
        logprobs_mode="processed_logprobs", wait_until_ready=False, stop_at_end_of_turn=args.apply_chat_template,
        **(routing_replay.engine_kwargs() if args.routing_replay else {}))
    warm_up = [engine.warm_up.remote() for engine in engines]  # each runs once its engine has started
    sleep = SleepSchedule(engines, enabled=args.colocate_all)  # a recorded no-op where vLLM cannot sleep
    if args.colocate_all:  # asleep before the models load into the memory the engines give back
        wait_for_engines(engines, warm_up)
        sleep.start()
    # Every role then loads its model while the engines start: each start is mostly imports and reading weights.
    start = functools.partial(WorkerGroup, cpus_per_bundle=cpus, wait_until_ready=False)
    actor_pg = shared or make_placement_group(args.actor_num_workers, cpus, "actor")
    cluster = Cluster(engines=engines, sleep=sleep)
    cluster.actor = start(actor_cls, actor_pg, shares["actor"], args=(args, args.pretrain, total_actor_steps),
                          role="actor")
    if uses_reference(args) and not args.lora_rank:  # (with LoRA: ModelWorker.reference_logprobs)
        ref_pg = actor_pg if (args.colocate_actor_ref or args.colocate_all) else make_placement_group(
            args.ref_num_workers, cpus, "reference")
        cluster.ref = start(ModelWorker, ref_pg, shares["reference"], args=(args, args.pretrain), role="reference")
    if args.teacher_pretrain:  # placed as the reference is: --ref_num_workers, beside the actor when it is
        teacher_pg = actor_pg if (args.colocate_actor_ref or args.colocate_all) else make_placement_group(
            args.ref_num_workers, cpus, "teacher")
        cluster.teacher = start(ModelWorker, teacher_pg, shares["teacher"], args=(args, args.teacher_pretrain),
                                role="teacher")
    critic_pg = shared or make_placement_group(args.critic_num_workers, cpus, "critic") if use_critic else None
    if use_critic:
        cluster.critic = start(critic_cls, critic_pg, shares["critic"],
                               args=(args, critic_path(args), total_actor_steps), role="critic")
    for i, path in enumerate(reward_paths):
        pg = critic_pg if (args.colocate_critic_reward and critic_pg) else (
            shared or make_placement_group(args.reward_num_workers, cpus, f"reward model {i + 1}"))  # one name each
        cluster.rewards.append(start(ModelWorker, pg, shares["reward model"],
                                     args=(args, path, None, 0.0, "--reward_pretrain"), role=f"reward model {i + 1}"))
    wait_for_engines(engines, warm_up)
    groups = list(cluster.groups().values())
    for group in groups:
        group.ready()
    sleep.trainers = groups
    return cluster


def connect(args, cluster: Cluster, actor_in_experience: bool) -> None:
    """After placement: the weight-sync group between actor rank 0 and the engines; without GPUs, each phase's share
    of the cores for every worker (`actor_in_experience`: the actor computes in the experience phase too); and
    placement.json (each worker's Ray node, the engines' and workers' pids, the workers' threads per phase)."""
    engines = cluster.engines
    wait(cluster.actor.call("init_weight_sync", engines), SYNC_TIMEOUT.total_seconds(),
         "actor rank 0 and the vLLM engines did not form their weight-sync group")
    groups = {name: group for name, group in cluster.groups().items() if name in ("actor", "ref", "teacher",
                                                                                   "critic")}
    placement = {name: group.nodes for name, group in groups.items()}
    placement["rewards"] = [group.nodes for group in cluster.rewards]
    placement["pids"] = {name: group.get(group.call("pid")) for name, group in groups.items()}
    placement["vllm"] = ray.get([engine.node_id.remote() for engine in engines])
    placement["vllm_pids"] = ray.get([engine.pid.remote() for engine in engines])
    if not use_gpus():  # the workers computing at the same time share their node's cores
        experience = [g for g in (cluster.ref, cluster.teacher, cluster.critic, *cluster.rewards) if g]
        phases = {"experience": experience + ([cluster.actor] if actor_in_experience else []),
                  "train": [g for g in (cluster.actor, cluster.critic) if g]}
        share_cores(phases, {phase: placement["vllm"] if args.async_rollouts else [] for phase in phases})
        placement["cpu_threads"] = {name: group.get(group.call("threads")) for name, group in groups.items()}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "placement.json"), "w") as f:
        json.dump(placement, f, indent=1)
