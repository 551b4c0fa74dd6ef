"""Groups of Ray actors that together form one DeepSpeed world (one role of ppo_ray.py: actor, critic, ...).

Each role runs as `num_workers` Ray actors, one DeepSpeed rank each, with a torch.distributed world of their own:
the driver creates the actors, asks rank 0 for an address, then has every actor join. Roles are placed with Ray
placement groups: one bundle per worker (1 GPU, or `cpus` CPUs on a machine without GPUs); colocated roles share
the bundles of one group and each take a fraction of a bundle.

    pg = make_placement_group(2, 1, "actor")
    actor = WorkerGroup(ActorWorker, pg, share=0.5, cpus_per_bundle=1, args=(args,), role="actor")
    actor.get(actor.call("fit", experience))                               # every rank, the same arguments
    logprobs = gather(actor, actor.call_sharded("logprobs", shard(batch, 2, micro)), rows)  # a part of rows each

`WorkerGroup.get` is ray.get that stops within seconds, with WorkerDied, when a worker of the group has died: the
other ranks would otherwise wait in a collective until the process group's timeout.

Every wait on start-up is bounded: a role Ray cannot place, or whose model does not load, ends the run with one
sentence naming it instead of hanging.
"""

import os
from collections import Counter
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.args import UserError
from common.net import reserve_port

if TYPE_CHECKING:  # torch is imported where it is used: tests start twenty probe workers that never need it
    import torch

# Seconds Ray may take to reserve a placement group, or to start a role's actors on it; a layout that asks for more
# than the cluster has never gets there, so waiting longer only hides the mistake.
PLACE_TIMEOUT_S = 300
# Seconds a role's workers may take to set up (load and partition a model, 140 GB for a 70B one, from disk).
SETUP_TIMEOUT_S = 3600
PLACE_ADVICE = "lower the layout's worker counts or colocation, or give Ray more nodes"
# Colocated requests on one bundle may sum to this much (Ray adds float shares such as 0.2 x 5 with rounding error).
FULL_BUNDLE = 1.0 + 1e-6


class RayWorker:
    """What every role's actor can do before it loads a model: report an address and join its world."""

    cpu_threads: dict[str, int] = {}  # phase -> torch threads, set by share_cores on a machine without GPUs

    def address(self) -> tuple[str, int]:
        """Where this rank 0's world meets: the port stays reserved until init_distributed binds it."""
        return ray.util.get_node_ip_address(), reserve_port()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This worker's process id (placement.json), so that an operator or a test can end exactly this worker."""
        return os.getpid()

    def empty_cache(self) -> None:
        """Hand the blocks torch's CUDA allocator keeps cached back to the GPU, for a colocated vLLM engine to use."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def join_world(self, rank: int, world_size: int, master: tuple[str, int]) -> None:
        """Set the variables torch.distributed and DeepSpeed read; the worker's setup then calls init_distributed().

        LOCAL_RANK is the index of this worker's GPU among the devices it can see, not its position among the
        workers of its node: DeepSpeed passes LOCAL_RANK to torch.cuda.set_device (engine, zero.Init), and Ray
        shows each GPU actor only its own GPU, so a second worker on a node holding LOCAL_RANK 1 fails with
        "invalid device ordinal".
        """
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(visible_device_index()),
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))

    def set_cpu_threads(self, busy: dict[str, int]) -> None:
        """Share this node's cores with the `busy[phase]` workers (this one included) computing there in each phase."""
        cores = len(os.sched_getaffinity(0))
        self.cpu_threads = {phase: max(1, cores // n) for phase, n in busy.items()}

    def threads(self) -> dict[str, int]:
        return self.cpu_threads

    def use_cpu_threads(self, phase: str) -> None:
        """Compute `phase` with the threads set_cpu_threads gave it (unchanged where it gave none: on GPUs)."""
        if phase in self.cpu_threads:
            import torch

            torch.set_num_threads(self.cpu_threads[phase])


def share_cores(phases: dict[str, list["WorkerGroup"]], also_busy: dict[str, list[str]] | None = None) -> None:
    """On machines without GPUs, split each node's cores among the workers computing there in each phase.

    `phases` maps a phase to the groups that compute in it at the same time; `also_busy` a phase to the nodes of
    other processes computing meanwhile (vLLM engines that generate during it), one entry per process. Ray starts a
    CPU actor with OMP_NUM_THREADS set to its CPU request, 1 by default, so a trainer alone in its phase used one
    core while the rest of the node idled: GRPO's update of a 21M model took 1.4x its time on the 2 cores there were.
    """
    busy = {phase: Counter([node for g in groups for node in g.nodes] + (also_busy or {}).get(phase, []))
            for phase, groups in phases.items()}
    groups = list({id(g): g for groups in phases.values() for g in groups}.values())
    ray.get([actor.set_cpu_threads.remote({phase: busy[phase][node] for phase in phases if group in phases[phase]})
             for group in groups for actor, node in zip(group.actors, group.nodes)])


def visible_device_index() -> int:
    """The index, among the CUDA devices this process can see, of the first GPU Ray gave it (0 without GPUs).

    Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU ids (ray/_private/accelerators/nvidia_gpu.py,
    set_current_process_visible_accelerator_ids), so this is 0, unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    left every GPU of the node visible, as vLLM's own Ray workers do.
    """
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    if not gpu_ids:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return int(gpu_ids[0])
    return visible.split(",").index(gpu_ids[0])


def use_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def gpu_rank_threads() -> dict[str, str]:
    """On GPUs, the OMP_NUM_THREADS of a trainer rank: its GPU's share of its node's cores (the fewest of any node).

    Ray starts an actor that asks for less than one CPU with OMP_NUM_THREADS=1, so DeepSpeed's CPU Adam
    (--offload_optimizer), which steps on OpenMP threads, and every CPU op of torch ran on one core. (Without GPUs,
    share_cores splits the cores per phase instead.) A value the driver was started with is passed on as it is."""
    if not use_gpus():
        return {}
    if "OMP_NUM_THREADS" in os.environ:
        return {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    per_gpu = min(node["Resources"].get("CPU", 0) // node["Resources"]["GPU"] for node in ray.nodes()
                  if node["Alive"] and node["Resources"].get("GPU"))
    return {"OMP_NUM_THREADS": str(max(1, int(per_gpu)))}


def check_resources(needed: dict[str, float]) -> None:
    """Fail in one sentence, before anything starts, when the cluster has fewer CPUs/GPUs than the layout needs."""
    kind = "GPU" if use_gpus() else "CPU"
    total = sum(needed.values())
    have, free = ray.cluster_resources().get(kind, 0), ray.available_resources().get(kind, 0)
    if total > free:
        layout = ", ".join(f"{role} {n:g}" for role, n in needed.items())
        raise UserError(f"this layout needs {total:g} {kind}s ({layout}) but the Ray cluster has {have:g} "
                        f"({free:g} free); ask for fewer workers or engines, colocate roles, or add nodes.")


def check_bundle_shares(group: str, shares: dict[str, float]) -> None:
    """Fail in one sentence, before anything is placed, when the roles colocated on one placement group ask for more
    than a whole bundle each: Ray would keep the last of them pending forever."""
    total = sum(shares.values())
    if total > FULL_BUNDLE:
        asked = " + ".join(f"{role} {share:g}" for role, share in shares.items())
        raise UserError(f"the roles colocated on the {group} GPUs ask for {asked} = {total:g} of each GPU, more than "
                        f"one; colocate fewer roles (or fewer reward models) there, or give some of them GPUs of "
                        f"their own.")


def make_placement_group(num_bundles: int, cpus_per_bundle: float, name: str):
    """One bundle per worker (a GPU and a CPU, or CPUs alone), spread over nodes only when one is not enough."""
    bundle = {"GPU": 1, "CPU": 1} if use_gpus() else {"CPU": cpus_per_bundle}
    pg = placement_group([dict(bundle) for _ in range(num_bundles)], strategy="PACK", name=name)
    wait(pg.ready(), PLACE_TIMEOUT_S, f"Ray could not reserve the {name} bundles ({num_bundles} x {bundle})")
    return pg


def bundle_nodes(pg) -> dict[int, str]:
    """{bundle index: the Ray node it was reserved on} of a ready placement group."""
    return placement_group_table(pg)["bundles_to_node_id"]


def by_node(nodes: dict[int, str]) -> dict[str, list[int]]:
    """Bundle indices grouped by node, nodes in the order of their first bundle. Ray keeps no order between a PACK
    group's bundles and its nodes (ray-project/ray#51117): bundles 0 and 2 may share a node that 1 is not on."""
    grouped = {}
    for bundle in sorted(nodes):
        grouped.setdefault(nodes[bundle], []).append(bundle)
    return grouped


def rank_bundles(nodes: dict[int, str]) -> list[int]:
    """The bundle of each rank of a role: one node's ranks consecutive, as torch.distributed and NCCL's rings expect
    of ranks numbered across nodes, and as tensor_parallel_bundles numbers vLLM's workers on a shared group."""
    return [bundle for bundles in by_node(nodes).values() for bundle in bundles]


def tensor_parallel_bundles(nodes: dict[int, str], num_engines: int, tensor_parallel_size: int) -> list[list[int]]:
    """Each engine's `tensor_parallel_size` bundles, all on one node (its all-reduces of every layer never cross the
    network), taken in rank_bundles' order; one sentence if the bundles cannot be split so."""
    groups = [bundles[i:i + tensor_parallel_size] for bundles in by_node(nodes).values()
              for i in range(0, len(bundles) - tensor_parallel_size + 1, tensor_parallel_size)]
    if len(groups) < num_engines:
        counts = ", ".join(str(len(bundles)) for bundles in by_node(nodes).values())
        raise UserError(f"{num_engines} vLLM engine(s) at tensor parallel {tensor_parallel_size} need that many GPUs "
                        f"on one node each, and Ray reserved their GPUs {counts} to a node; give each node a multiple "
                        f"of --vllm_tensor_parallel_size GPUs, or lower --vllm_tensor_parallel_size.")
    return groups[:num_engines]


def wait(refs, timeout: float, failure: str, advice: str = PLACE_ADVICE):
    """ray.get(refs) for at most `timeout` seconds; past it, one sentence: `failure`, what Ray has free, `advice`.

    Every start-up wait goes through here, so that a role that can never be placed ends the run instead of hanging.
    """
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        raise unwrapped(e) from None
    except ray.exceptions.GetTimeoutError:
        free = ray.available_resources()
        raise UserError(f"{failure} within {timeout:g} s ({free.get('GPU', 0):g} GPUs and {free.get('CPU', 0):g} "
                        f"CPUs free in the Ray cluster); {advice}.") from None


def unwrapped(error: "ray.exceptions.RayTaskError") -> Exception:
    """A worker's UserError (its sentence for the user) without Ray's remote traceback; any other error as it is."""
    return error.cause if isinstance(error.cause, UserError) else error


class WorkerGroup:
    """`num_workers` actors of `cls`, one per bundle of `pg`, joined into one torch.distributed world.

    The constructor waits until every worker has set up. With `wait_until_ready` False it returns at once, every
    start-up call queued (each actor runs its calls in the order they were made), so that several roles load their
    models at the same time; ready() then waits for them.
    """

    def __init__(self, cls, pg, share: float, cpus_per_bundle: float, args: tuple = (), env: dict | None = None,
                 role: str | None = None, wait_until_ready: bool = True):
        role = self.role = role or cls.__name__
        num_workers = len(pg.bundle_specs)
        self.resources = {"num_gpus": share, "num_cpus": share} if use_gpus() else {"num_cpus": share * cpus_per_bundle}
        env = {**gpu_rank_threads(), **(env or {})}
        self.bundles = rank_bundles(bundle_nodes(pg))  # rank i's bundle
        self.actors = [
            ray.remote(cls).options(
                **self.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": env},
            ).remote()
            for bundle in self.bundles
        ]
        address = self.actors[0].address.remote()  # Ray hands its result to join_world once rank 0 has started
        self.starting = {"placed": [a.node_id.remote() for a in self.actors],
                         "joined": [a.join_world.remote(i, num_workers, address) for i, a in enumerate(self.actors)],
                         "set up": [a.setup.remote(*args) for a in self.actors]}
        if wait_until_ready:
            self.ready()

    def ready(self) -> None:
        """Wait until every worker has been placed, joined its world and set up; one sentence if one cannot."""
        placing = (f"Ray could not start the {self.role} workers ({len(self.actors)} x {self.resources} on their "
                   "bundles)")
        self.nodes = wait(self.starting["placed"], PLACE_TIMEOUT_S, placing)
        wait(self.starting["joined"], PLACE_TIMEOUT_S, placing)
        wait(self.starting["set up"], SETUP_TIMEOUT_S, f"the {self.role} workers did not finish loading their model",
             "check that every node reads the model folder fast enough, or raise common.ray_workers.SETUP_TIMEOUT_S")

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; returns the object refs (rank order)."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def get(self, refs: list) -> list:
        """ray.get(refs) of this group's calls; a worker that dies ends the wait at once (see get_alive)."""
        return get_alive(refs, f"a worker of the {self.role}")

    def call_sharded(self, method: str, shards: list, *args) -> list:
        """Call `method` on rank i with shards[i] (+ args); returns the object refs (rank order)."""
        return [getattr(a, method).remote(shard, *args) for a, shard in zip(self.actors, shards, strict=True)]

    def __len__(self) -> int:
        return len(self.actors)


def shard(batch: dict, n: int, micro: int) -> list[dict]:
    """Split a batch's rows into n equal consecutive parts, one per worker, each a whole number of micro-batches.

    Under ZeRO-3 every forward pass is collective, so every rank must run the same number of micro-batches: the
    batch is padded with copies of its last row, and callers keep the first len(batch) results.
    """
    import torch

    rows = len(batch["input_ids"])
    size = -(-rows // (n * micro)) * micro
    pad = [rows - 1] * (size * n - rows)
    index = torch.tensor(list(range(rows)) + pad)
    return [{k: v[index[i * size: (i + 1) * size]] for k, v in batch.items()} for i in range(n)]


def gather(group: "WorkerGroup", refs: list, rows: int) -> "torch.Tensor":
    """Concatenate the group's results in rank order and drop the padding rows shard() added."""
    import torch

    return torch.cat(group.get(refs))[:rows]


class WorkerDied(RuntimeError):
    """A role's worker is gone; the run stops and can be resumed from its last checkpoint."""


class WorkerHung(WorkerDied):
    """A role's worker is alive but has not finished a call that others wait on; the run stops as for a dead one."""


def get_alive(refs: list, what: str) -> list:
    """ray.get(refs), except that a worker that died ends the wait within seconds with WorkerDied(`what` died).

    The other ranks of its role would wait for its part of a collective until the process group's timeout (30
    minutes for DeepSpeed's), and a plain ray.get with them.
    """
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=2)
        check_alive(done, what)
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as e:  # e.g. checkpoint.SaveFailed: the disk is full
        raise unwrapped(e) from None


def check_alive(done: list, what: str) -> None:
    """Raise WorkerDied if one of the finished refs `done` is the call of an actor that died."""
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError:  # raised inside the call, also by another actor's death that the call
            pass                             # met (RayTaskError(ActorDiedError)): the caller reports it
        except ray.exceptions.RayActorError as e:
            raise WorkerDied(f"{what} died ({type(e).__name__})") from None
