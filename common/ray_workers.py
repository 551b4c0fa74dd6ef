"""Groups of Ray actors that together form one DeepSpeed world (one role of ppo_ray.py: actor, critic, ...).

Each role runs as `num_workers` Ray actors, one DeepSpeed rank each, with a torch.distributed world of their own:
the driver creates the actors, asks rank 0 for an address, then has every actor join. Roles are placed with Ray
placement groups: one bundle per worker (1 GPU, or `cpus` CPUs on a machine without GPUs); colocated roles share
the bundles of one group and each take a fraction of a bundle.

    pg = make_placement_group(2, "actor+ref")
    actor = WorkerGroup(PolicyWorker, pg, share=0.5, args=(args,))
    ray.get(actor.call("fit", experience))          # every rank, the same arguments
    ray.get(actor.call_sharded("logprobs", shards))  # one shard each
"""

import os

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.args import UserError
from common.net import free_port


class RayWorker:
    """What every role's actor can do before it loads a model: report an address and join its world."""

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def join_world(self, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int) -> None:
        """Set the variables torch.distributed reads; the worker's setup then calls init_distributed()."""
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))


def use_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def check_resources(needed: dict[str, float]) -> None:
    """Fail in one sentence, before anything starts, when the cluster has fewer CPUs/GPUs than the layout needs."""
    kind = "GPU" if use_gpus() else "CPU"
    total = sum(needed.values())
    have, free = ray.cluster_resources().get(kind, 0), ray.available_resources().get(kind, 0)
    if total > free:
        layout = ", ".join(f"{role} {n:g}" for role, n in needed.items())
        raise UserError(f"this layout needs {total:g} {kind}s ({layout}) but the Ray cluster has {have:g} "
                        f"({free:g} free); ask for fewer workers or engines, colocate roles, or add nodes.")


def make_placement_group(num_bundles: int, cpus_per_bundle: float, name: str):
    """One bundle per worker (a GPU and a CPU, or CPUs alone), spread over nodes only when one is not enough."""
    bundle = {"GPU": 1, "CPU": 1} if use_gpus() else {"CPU": cpus_per_bundle}
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise UserError(f"Ray could not place {name} ({num_bundles} x {bundle}) in 300 s; the cluster has "
                        f"{ray.available_resources()} free.") from None
    return pg


class WorkerGroup:
    """`num_workers` actors of `cls`, one per bundle of `pg`, joined into one torch.distributed world."""

    def __init__(self, cls, pg, share: float, cpus_per_bundle: float, args: tuple = (), env: dict | None = None):
        num_workers = len(pg.bundle_specs)
        resources = {"num_gpus": share, "num_cpus": share} if use_gpus() else {"num_cpus": share * cpus_per_bundle}
        self.actors = [
            ray.remote(cls).options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env or {}},
            ).remote()
            for i in range(num_workers)
        ]
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        nodes = ray.get([a.node_id.remote() for a in self.actors])
        local_ranks = [nodes[:i].count(node) for i, node in enumerate(nodes)]
        ray.get([a.join_world.remote(i, num_workers, local_ranks[i], master_addr, master_port)
                 for i, a in enumerate(self.actors)])
        ray.get([a.setup.remote(*args) for a in self.actors])
        self.nodes = nodes

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; returns the object refs (rank order)."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call_sharded(self, method: str, shards: list, *args) -> list:
        """Call `method` on rank i with shards[i] (+ args); returns the object refs (rank order)."""
        return [getattr(a, method).remote(shard, *args) for a, shard in zip(self.actors, shards, strict=True)]

    def __len__(self) -> int:
        return len(self.actors)
