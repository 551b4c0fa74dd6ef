"""Stand-ins for ppo_ray.py's workers and vLLM engines that load no model and only report where Ray put them.

tests/test_placement.py runs placement.place_roles with these: the real placement groups, shares, WorkerGroup and
create_vllm_engines code, on a Ray cluster of CPUs that pretends to have GPUs. Kept free of torch and ppo_ray
imports, since every probe is a Ray worker process of its own and a simulated 16-GPU layout starts about twenty.
"""

import os
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.ray_workers import RayWorker, WorkerGroup


def report() -> dict:
    """Where the calling actor runs and what Ray granted it, as CUDA and torch.distributed would see it."""
    granted = ray.get_runtime_context().get_assigned_resources()
    node, gpu_ids = ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]
    return {"node": node, "gpu_ids": gpu_ids, "gpu": simulated_uuid(node, gpu_ids[0]) if gpu_ids else None,
            "gpu_share": sum(v for k, v in granted.items() if k == "GPU" or k.startswith("GPU_group_")
                             and k.count("_") == 2),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "RANK": os.environ.get("RANK"), "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def simulated_uuid(node: str, physical_id: str) -> str:
    """A stand-in for the UUID of GPU `physical_id` of `node` (weight_sync.device_placement's "gpu")."""
    return f"GPU-{node[:8]}-{physical_id}"


def vllm_devices(reports: list[dict]) -> list[dict]:
    """Tensor-parallel workers' reports with the GPU each computes on as vLLM's Ray executor picks it
    (vllm/v1/executor/ray_executor_v2.py): the worker of local rank r on a node gets the r-th of the sorted Ray GPU
    ids of that node's workers, not its own bundle's."""
    nodes = {}
    for rep in reports:
        nodes.setdefault(rep["node"], []).append(rep)
    return [{**rep, "gpu": simulated_uuid(rep["node"], sorted(r["gpu_ids"][0] for r in nodes[rep["node"]])[
        nodes[rep["node"]].index(rep)])} for rep in reports]


class ProbeWorker(RayWorker):
    """A role's rank: joins its world like the real workers (RayWorker.join_world) but loads nothing."""

    def setup(self, role: str, share: float) -> None:
        self.role, self.share, self.setup_time = role, share, time.time()

    def started(self) -> float:
        """When this worker loaded its (absent) model."""
        return self.setup_time

    def report(self) -> dict:
        return {"role": self.role, **report()}

    def plan_weight_sync(self, engines: list) -> list[str]:
        """The transports init_weight_sync_group would use from this rank (0 of the actor) to each vLLM worker:
        weight_sync.sync_transports with this rank's simulated GPU, which CUDA would name."""
        from common.weight_sync import plan_transports

        placements = ray.get([engine.placement.remote() for engine in engines], timeout=60)
        return plan_transports(report(), [worker for engine in placements for worker in engine])


def probe_group(cls, pg, share, cpus_per_bundle, args=(), env=None, role=None, wait_until_ready=True):
    """WorkerGroup as placement.place_roles builds it, with the model-loading class and arguments swapped out (they
    would import ppo_ray, torch and transformers in every probe process)."""
    group = WorkerGroup(ProbeWorker, pg, share, cpus_per_bundle, (role, share), env, role, wait_until_ready)
    return group


class ProbeTPWorker:
    """One of vLLM's own Ray workers of a tensor-parallel engine."""

    def report(self) -> dict:
        return report()


class ProbeEngine:
    """VLLMEngine's constructor and start-up methods. With tensor parallelism it starts its workers as vLLM's Ray
    executor does (vllm/v1/executor/ray_executor.py, _init_workers_ray): one actor per bundle of
    VLLM_RAY_BUNDLE_INDICES, num_gpus=VLLM_RAY_PER_WORKER_GPUS, CUDA_VISIBLE_DEVICES left unset by Ray."""

    def __init__(self, pretrain_path, seed, max_model_len, tensor_parallel_size, gpu_memory_utilization,
                 enforce_eager, dtype, enable_sleep_mode, use_gpu, bundle_indices, llm_kwargs, stop_at_end_of_turn):
        self.tp, self.bundle_indices, self.use_gpu = tensor_parallel_size, bundle_indices, use_gpu
        self.enable_sleep_mode = enable_sleep_mode
        self.slept_at = []
        self.workers = []
        if bundle_indices is not None:
            pg = ray.util.get_current_placement_group()
            share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
            self.workers = [ray.remote(ProbeTPWorker).options(
                num_cpus=0, num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b,
                                                                     placement_group_capture_child_tasks=True),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            ).remote() for b in bundle_indices]
            ray.get([w.report.remote() for w in self.workers], timeout=60)

    def ready(self) -> bool:
        return True

    def warm_up(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        assert self.enable_sleep_mode or not self.use_gpu, "sleep() on a GPU engine created without sleep mode"
        self.slept_at.append(time.time())

    def sleep_times(self) -> list[float]:
        return self.slept_at

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def tensor_parallel_size(self) -> int:
        return self.tp

    def placement(self) -> list[dict]:
        """One report per vLLM worker (VLLMEngine.placement's, and more): the engine actor itself without tensor
        parallelism, else its Ray workers."""
        if not self.workers:
            return [report()]
        return vllm_devices(ray.get([w.report.remote() for w in self.workers], timeout=60))


class HangingEngine(ProbeEngine):
    """An engine whose start never ends, as one does when vLLM waits for memory or a rendezvous that never comes."""

    def __init__(self, *args):
        import time

        time.sleep(10**6)
