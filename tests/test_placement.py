"""ppo_ray.py's placement on GPU clusters, simulated on CPU: Ray with virtual GPUs, probe workers, no models.

Ray told that a node has 8 GPUs (`ray.init(num_gpus=8)`, or `ray.cluster_utils.Cluster` nodes for two) schedules
fractional GPU requests and sets each actor's CUDA_VISIBLE_DEVICES as it does on real GPUs. Every ppo_ray.py
layout of launch/ (read from the recipes themselves, so a changed recipe is checked as written) goes through the
real placement.place_roles, WorkerGroup and create_vllm_engines with probes standing in for the models (see
tests/placement_probe.py), and each rank reports node, bundle, CUDA_VISIBLE_DEVICES, LOCAL_RANK, RANK and its
weight-sync transport. What a first GPU run would otherwise find out:
  - LOCAL_RANK names a device the worker can see (DeepSpeed calls torch.cuda.set_device(LOCAL_RANK));
  - no GPU carries more than 1.0 of requests;
  - no two ranks of one NCCL group (a role's DeepSpeed world, the weight-sync group) share a GPU (NCCL refuses);
  - a vLLM worker on actor rank 0's own GPU (--colocate_all) is planned over CUDA IPC and left out of the
    weight-sync group;
  - every wait on start-up ends, in one sentence naming the role, instead of hanging.
"""

import ast
import glob
import inspect
import os
import re
import sys
import textwrap
import time
from collections import defaultdict

import placement_probe
import pytest
import ray
from conftest import ROOT
from test_launch import invocations, shell_text

import ppo_ray
from common import placement, ray_workers, vllm_engine
from common.args import UserError, parse_args
from common.weight_sync import group_ranks

TESTS = os.path.dirname(os.path.abspath(__file__))


def place_roles(args: ppo_ray.Args) -> placement.Cluster:
    return placement.place_roles(args, 1, ppo_ray.ActorWorker, ppo_ray.CriticWorker)


# ------------------------------------------------------------------------------------------------ layouts
def recipe_layouts() -> list[tuple[str, int, list[str]]]:
    """(recipe, nodes, ppo_ray.py flags) for every ppo_ray.py command in launch/, with the node count its
    `Hardware` line names ("1 node, 8 GPUs", "2 nodes x 8 GPUs"); shell variables become a placeholder."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "launch", "*.sh")) + glob.glob(os.path.join(ROOT, "launch",
                                                                                                  "*.sbatch"))):
        text = shell_text(path)
        for script, words in invocations(text):
            if script != "ppo_ray":
                continue
            hardware = re.search(r"Hardware\s+(\d+) nodes?(?:,| x) (\d+) GPUs", text)
            assert hardware and hardware.group(2) == "8", f"{path}: no 'Hardware  N node(s) x 8 GPUs' line"
            flags = [w for w in words if w not in ("$@", "$*")]
            found.append((os.path.basename(path), int(hardware.group(1)), flags))
    return found


def distinct(layouts: list[tuple[str, int, list[str]]]) -> list[tuple[str, int, list[str]]]:
    """One entry per distinct layout (launch/slurm_ppo.sbatch runs launch/ppo_70b_16gpu.sh's), named after all its
    recipes: each simulated 16-GPU cluster costs a minute of this machine's CPUs."""
    merged = {}
    for name, nodes, flags in layouts:
        key = (nodes, tuple("$" if "$" in w else w for w in flags))
        merged[key] = (merged[key][0] + " = " + name if key in merged else name, nodes, flags)
    return list(merged.values())


RECIPES = recipe_layouts()
# Layouts the docs describe beyond the recipes (docs/ppo.md, Colocation).
EXTRA = [
    ("colocate_all, 4 GPUs", 1, ["--pretrain", "$SFT", "--colocate_all", "--actor_num_workers", "4",
                                "--vllm_num_engines", "4", "--reward_pretrain", "$RM"]),
    ("colocate_all, 4 GPUs, tensor parallel 2", 1, ["--pretrain", "$SFT", "--colocate_all",
                                                    "--actor_num_workers", "4",
                                                    "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "2",
                                                    "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4",
                                                    "--reward_pretrain", "$RM"]),
]


def layout_args(flags: list[str], model: str) -> ppo_ray.Args:
    """The Args the flags give, every shell variable standing for the placeholder model folder."""
    return parse_args(ppo_ray.Args, [model if "$" in w else w for w in flags])


# ------------------------------------------------------------------------------------------------ the cluster
@pytest.fixture
def model(tmp_path) -> str:
    """A folder that passes check_model_path: the probes never read it."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def probes(monkeypatch):
    """placement.place_roles with probe workers and engines, and start-up timeouts short enough for a test."""
    monkeypatch.setattr(placement, "WorkerGroup", placement_probe.probe_group)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", placement_probe.ProbeEngine)
    monkeypatch.setattr(ray_workers, "PLACE_TIMEOUT_S", 180)  # probes start in seconds, on a busy CPU in a minute
    monkeypatch.setattr(ray_workers, "SETUP_TIMEOUT_S", 180)
    monkeypatch.setattr(vllm_engine, "ENGINE_START_TIMEOUT_S", 180)


RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, TESTS])}}


def start_cluster(nodes: int, gpus: int, cpus: int):
    """A local Ray cluster of `nodes` nodes with `gpus` virtual GPUs each; returns what to shut down."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    small = {"object_store_memory": 80 * 2**20}
    if nodes == 1:
        ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
                 runtime_env=RUNTIME_ENV, **small)  # "local": this test's own Ray, whatever else runs here
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": gpus,
                                                            "include_dashboard": False, **small})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus, num_gpus=gpus, **small)
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=RUNTIME_ENV)
    return cluster


def stop_cluster(cluster) -> None:
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


def collect(cluster: placement.Cluster) -> tuple[list[dict], list[dict], list[str]]:
    """(every trainer-side rank's report with its role and bundle, every vLLM worker's report with its engine,
    the weight-sync transport to each vLLM worker as actor rank 0 plans it)."""
    ranks = []
    for name, group in cluster.groups().items():
        for bundle, rep in zip(group.bundles, ray.get(group.call("report"), timeout=60), strict=True):
            ranks.append({**rep, "role": name, "bundle": bundle})
    workers = []
    for i, engine in enumerate(cluster.engines):
        for tp_rank, rep in enumerate(ray.get(engine.placement.remote(), timeout=60)):
            workers.append({**rep, "role": f"vLLM engine {i}", "tp_rank": tp_rank})
    transports = ray.get(cluster.actor.actors[0].plan_weight_sync.remote(cluster.engines), timeout=120)
    return ranks, workers, transports


def gpu(rep: dict) -> tuple[str, str]:
    assert len(rep["gpu_ids"]) == 1, rep
    return rep["node"], rep["gpu_ids"][0]


def check_layout(ranks: list[dict], workers: list[dict], transports: list[str]) -> None:
    """Assert everything the module docstring lists."""
    for rep in ranks:  # DeepSpeed: torch.cuda.set_device(LOCAL_RANK) must name a device this process sees
        visible = rep["CUDA_VISIBLE_DEVICES"].split(",")
        assert int(rep["LOCAL_RANK"]) < len(visible) and visible[int(rep["LOCAL_RANK"])] == rep["gpu_ids"][0], rep
    load = defaultdict(float)
    for rep in ranks + workers:
        load[gpu(rep)] += rep["gpu_share"]
    assert max(load.values()) <= 1.0 + 1e-6, dict(load)
    by_role = defaultdict(list)
    for rep in ranks:
        by_role[rep["role"]].append(rep)
    for role, reps in by_role.items():  # each role is one DeepSpeed world over NCCL
        assert sorted(int(r["RANK"]) for r in reps) == list(range(len(reps))), (role, reps)
        assert len({gpu(r) for r in reps}) == len(reps), f"two {role} ranks share a GPU: {reps}"
    for engine in {w["role"] for w in workers}:  # vLLM's tensor-parallel group, all-reducing every layer
        tp = [gpu(w) for w in workers if w["role"] == engine]
        assert len(set(tp)) == len(tp), f"{engine} puts two tensor-parallel ranks on one GPU: {tp}"
        assert len({node for node, _ in tp}) == 1, f"{engine} spreads its tensor-parallel ranks over nodes: {tp}"
    trainer = next(r for r in ranks if r["role"] == "actor" and r["RANK"] == "0")
    nccl = [gpu(trainer)] + [gpu(w) for w, t in zip(workers, transports) if t == "nccl"]
    assert len(set(nccl)) == len(nccl), f"the weight-sync NCCL group puts two ranks on one GPU: {nccl}"
    for w, t in zip(workers, transports):  # a vLLM worker computing on the trainer's own GPU is reached over CUDA IPC
        assert (t == "ipc") == (w["gpu"] == trainer["gpu"]), (w, t)
    tp_sizes = [sum(w["role"] == engine for w in workers) for engine in dict.fromkeys(w["role"] for w in workers)]
    ranks, world_size = group_ranks(transports, tp_sizes)  # the weight-sync group: trainer rank 0 and NCCL workers
    assert world_size == 1 + transports.count("nccl")
    assert [r is None for engine in ranks for r in engine] == [t == "ipc" for t in transports]


def place(args: ppo_ray.Args) -> tuple[list[dict], list[dict], list[str]]:
    cluster = place_roles(args)
    ranks, workers, transports = collect(cluster)
    check_layout(ranks, workers, transports)
    check_engines_sleep_first(args, cluster)
    return ranks, workers, transports


def check_engines_sleep_first(args: ppo_ray.Args, cluster: placement.Cluster) -> None:
    """Under --colocate_all every engine has gone to sleep (handing its GPU memory back) before any model loads:
    vLLM takes --vllm_gpu_memory_utilization of the GPU at start, which the models would otherwise not find."""
    slept = [ray.get(engine.sleep_times.remote(), timeout=60) for engine in cluster.engines]
    if not args.colocate_all:
        assert slept == [[] for _ in slept], slept
        return
    groups = list(cluster.groups().values())
    first_load = min(t for g in groups for t in ray.get(g.call("started"), timeout=60))
    assert all(len(times) == 1 and times[0] < first_load for times in slept), (slept, first_load)


# ------------------------------------------------------------------------------------------------ tests
LAYOUTS = distinct(RECIPES) + EXTRA


@pytest.mark.slow
@pytest.mark.parametrize("name,nodes,flags", LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
def test_layout_places_every_rank_on_a_gpu_it_can_use(name, nodes, flags, model, probes, capsys):
    args = layout_args(flags, model)
    cluster = start_cluster(nodes, gpus=8, cpus=8)
    try:
        ranks, workers, transports = place(args)
    finally:
        stop_cluster(cluster)
    with capsys.disabled():  # the placement, for whoever reads the test log
        print(f"\n{name}:")
        for rep in ranks + workers:
            print(f"  {rep['role']:<15} rank {rep.get('RANK') or rep.get('tp_rank')} bundle {rep.get('bundle', '-')}"
                  f" node {rep['node'][:8]} CUDA_VISIBLE_DEVICES={rep['CUDA_VISIBLE_DEVICES']} "
                  f"LOCAL_RANK={rep['LOCAL_RANK']} gpu {rep['gpu_ids']} share {rep['gpu_share']:g}")
        print(f"  weight sync: {transports}")
    expected_nodes = len({r["node"] for r in ranks + workers})
    assert expected_nodes == nodes, f"{name} is meant for {nodes} node(s) but used {expected_nodes}"


def test_layouts_were_found():
    names = [name for name, _, _ in RECIPES]
    assert {"llama8b_8gpu_ppo.sh", "ppo_70b_16gpu.sh", "slurm_ppo.sbatch"} <= set(names), names


@pytest.mark.parametrize("flags,words", [
    (["--colocate_critic_reward", "--reward_pretrain", "$A", "$B"], ["critic 0.5", "reward model 2 0.5", "1.5"]),
    (["--colocate_all", "--reward_pretrain", "$A", "$B"], ["vLLM 0.2", "1.2"]),
    (["--colocate_all", "--colocate_critic_reward", "--reward_pretrain", "$A"], ["critic 0.5", "1.6"]),
])
def test_oversubscribed_bundles_are_refused_before_placing(flags, words, model):
    args = layout_args(flags, model)
    with pytest.raises(UserError) as e:
        placement.check_colocation(args, placement.role_shares(args))
    message = str(e.value)
    assert all(w in message for w in words) and "give some of them GPUs of their own" in message, message
    assert message.count(". ") == 0 and message.endswith("."), message  # one sentence


@pytest.mark.slow
def test_reward_models_on_gpus_of_their_own_and_each_rank_s_cpu_threads(model, probes, monkeypatch):
    """Two reward models, each on GPUs of its own: their placement groups had one name, which Ray refuses for the
    second. The up-front count has them where no critic takes them in (it had 0) and no reference at --init_kl_coef 0
    (it had 1, and refused this layout on 4 GPUs). Every trainer rank gets its GPU's share of the node's cores as
    OMP_NUM_THREADS: Ray gave a rank asking for under one CPU a single thread, on which DeepSpeed's CPU Adam
    (--offload_optimizer) stepped."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = layout_args(["--pretrain", "$SFT", "--advantage_estimator", "grpo", "--init_kl_coef", "0",
                        "--reward_pretrain", "$A", "$B"], model)
    cluster = start_cluster(1, gpus=4, cpus=16)
    try:
        # without a critic to sit beside, --colocate_critic_reward leaves them on GPUs of their own, counted up front
        crowded = layout_args(["--pretrain", "$SFT", "--advantage_estimator", "grpo", "--colocate_critic_reward",
                               "--reward_num_workers", "2", "--reward_pretrain", "$A", "$B"], model)
        with pytest.raises(UserError, match=r"needs 7 GPUs \(actor 1, reference 1, reward models 4, vLLM 1\) but "
                                            r"the Ray cluster has 4 \(4 free\)"):
            place_roles(crowded)
        ranks, workers, transports = place(args)
    finally:
        stop_cluster(cluster)
    assert sorted(r["role"] for r in ranks) == ["actor", "reward model 1", "reward model 2"]
    assert len({gpu(r) for r in ranks + workers}) == 4
    assert all(r["OMP_NUM_THREADS"] == "4" for r in ranks), ranks


@pytest.mark.slow
def test_colocate_all_on_cpu_places_the_engines_on_the_shared_bundles(model, probes):
    """On CPU the engine asked for a whole bundle that the roles already held 0.2 x 4 of, and waited forever."""
    args = layout_args(["--pretrain", "$SFT", "--colocate_all", "--actor_num_workers", "2",
                        "--vllm_num_engines", "2", "--reward_pretrain", "$RM"], model)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=RUNTIME_ENV,
             object_store_memory=80 * 2**20)
    try:
        _, workers, transports = collect(place_roles(args))
    finally:
        ray.shutdown()
    # one host: the engines are planned to copy their weights out of the trainer's shared memory
    assert len(workers) == 2 and all(w["gpu_ids"] == [] for w in workers) and transports == ["shm", "shm"]


@pytest.mark.slow
def test_every_start_up_wait_ends_in_one_sentence_naming_the_role(model, probes, monkeypatch):
    cluster = start_cluster(1, gpus=2, cpus=2)
    try:
        pg = ray_workers.make_placement_group(2, 1, "critic")
        critic = placement_probe.probe_group(None, pg, 0.9, 1, role="critic")  # noqa: F841 (holds its GPUs)
        monkeypatch.setattr(ray_workers, "PLACE_TIMEOUT_S", 5)  # what follows cannot be placed: no need to wait long
        monkeypatch.setattr(vllm_engine, "ENGINE_START_TIMEOUT_S", 5)
        with pytest.raises(UserError, match=r"^Ray could not start the reward model 2 workers .* within 5 s"):
            placement_probe.probe_group(None, pg, 0.5, 1, role="reward model 2")  # 0.9 + 0.5 of one GPU
        with pytest.raises(UserError, match=r"^the vLLM engines \(2 vLLM engine.* did not start within 5 s"):
            vllm_engine.create_vllm_engines(2, 1, model, 0, 64, placement_group=pg)  # 0.9 + 0.2
        ray.util.remove_placement_group(pg)
        deadline = time.time() + 30
        while ray.available_resources().get("GPU", 0) < 2 and time.time() < deadline:  # removal is asynchronous
            time.sleep(0.2)
        monkeypatch.setattr(vllm_engine, "VLLMEngine", placement_probe.HangingEngine)
        with pytest.raises(UserError, match=r"^the vLLM engines \(1 vLLM engine.* did not start within 5 s"):
            vllm_engine.create_vllm_engines(1, 1, model, 0, 64)  # placed, but its start never ends
    finally:
        stop_cluster(cluster)


def ray_gets_without_timeout(source: str) -> list[str]:
    """`ray.get(...)` calls in `source` that give no timeout."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.get"
                and not any(k.arg == "timeout" for k in node.keywords)):
            found.append(ast.unparse(node))
    return found


@pytest.mark.slow
def test_shutting_engines_down_leaves_those_that_fail_or_hang_to_ray():
    """shutdown_engines ends every run that finishes: an engine whose shutdown raises, or never returns, must
    neither fail the run nor hold it up beyond the timeout."""

    @ray.remote(num_cpus=0)
    class FailingEngine:
        def shutdown(self):
            raise RuntimeError("vLLM could not shut down")

    @ray.remote(num_cpus=0)
    class HangingEngine:
        def shutdown(self):
            time.sleep(600)

    cluster = start_cluster(1, gpus=0, cpus=2)
    try:
        engines = [FailingEngine.remote(), HangingEngine.remote()]
        ray.get([engine.__ray_ready__.remote() for engine in engines], timeout=60)
        start = time.monotonic()
        vllm_engine.shutdown_engines(engines, timeout_s=2)
        assert time.monotonic() - start < 20
    finally:
        stop_cluster(cluster)


def test_start_up_code_waits_on_ray_only_with_a_timeout():
    start_up = (ray_workers.RayWorker, ray_workers.WorkerGroup, ray_workers.make_placement_group, ray_workers.wait)
    sources = {**{f"ray_workers.{part.__name__}": inspect.getsource(part) for part in start_up},
               "create_vllm_engines": inspect.getsource(vllm_engine.create_vllm_engines),
               "placement.place_roles": inspect.getsource(placement.place_roles)}
    unbounded = {where: calls for where, source in sources.items() if (calls := ray_gets_without_timeout(source))}
    assert not unbounded, f"start-up waits without a timeout: {unbounded}"


@pytest.mark.slow
def test_gpu_smoke_layouts_fit_the_gpus_it_runs_on(model, probes):
    """`make gpu-smoke` (launch/gpu_smoke.py) places each PPO layout on the fewest GPUs it runs on: 2 for the stages
    with roles on separate GPUs (NEEDS_GPUS), 1 for the others."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import gpu_smoke

    stages = {stage: cmd[cmd.index("ppo_ray.py") + 1:cmd.index("--output_dir")]
              for stage, cmd in gpu_smoke.commands("/out", 2) if "ppo_ray.py" in cmd}
    # Stages whose flags change what runs, not where, are not placed again: LoRA only leaves out the reference,
    # which --colocate_all puts on the actor's own bundles.
    same_layout = {"ppo_async": "ppo", "ppo_packing": "ppo_all", "ppo_lora": "ppo_all", "ppo_qlora": "ppo_all",
                   "ppo_moe": "ppo_all"}
    for stage, like in same_layout.items():
        flags = stages.pop(stage)
        flags[flags.index("--pretrain") + 1] = stages[like][stages[like].index("--pretrain") + 1]  # ppo_moe's model
        assert set(flags) - set(stages[like]) <= {"--async_rollouts", "--packing_samples", "--lora_rank", "16",
                                                  "--load_in_4bit"}, stage
    for stage, flags in stages.items():
        flags[flags.index("--pretrain") + 1] = "$SFT"
        gpus = gpu_smoke.NEEDS_GPUS.get(stage, 1)
        cluster = start_cluster(1, gpus=gpus, cpus=4)
        try:
            args = layout_args(flags, model)
            ranks, workers, transports = place(args)
        finally:
            stop_cluster(cluster)
        assert len({gpu(rep) for rep in ranks + workers}) == gpus, stage
        assert ("ipc" in transports) == args.colocate_all and len(transports) == args.vllm_tensor_parallel_size, stage


@pytest.mark.parametrize("nodes,tp,engines,expected", [
    ({0: "a", 1: "b", 2: "a", 3: "b"}, 2, 2, [[0, 2], [1, 3]]),
    ({0: "b", 1: "a", 2: "a", 3: "b", 4: "a", 5: "a", 6: "b", 7: "b"}, 4, 2, [[0, 3, 6, 7], [1, 2, 4, 5]]),
    ({0: "a", 1: "b", 2: "a", 3: "b"}, 1, 4, [[0], [2], [1], [3]]),
])
def test_a_tensor_parallel_engine_takes_bundles_of_one_node(nodes, tp, engines, expected):
    """Ray keeps no order between a placement group's bundles and its nodes (ray#51117): engine i took bundles
    i*tp .. i*tp+tp-1, which may lie on two nodes, so that vLLM's all-reduce of every layer crossed the network. The
    bundles are grouped by node first (OpenRLHF's get_bundle_indices does the same), and a role's ranks follow that
    order, so that --colocate_all pairs actor rank i with vLLM worker i on one bundle."""
    assert ray_workers.tensor_parallel_bundles(nodes, engines, tp) == expected
    assert all(len({nodes[b] for b in bundles}) == 1 for bundles in expected)
    assert ray_workers.rank_bundles(nodes) == [b for bundles in ray_workers.tensor_parallel_bundles(
        nodes, len(nodes) // tp, tp) for b in bundles]


def test_engines_that_cannot_keep_to_one_node_are_refused_in_one_sentence():
    with pytest.raises(UserError, match=r"^2 vLLM engine\(s\) at tensor parallel 2 need .* Ray reserved their GPUs "
                                        r"3, 1 to a node; give each node a multiple of --vllm_tensor_parallel_size"):
        ray_workers.tensor_parallel_bundles({0: "a", 1: "a", 2: "b", 3: "a"}, 2, 2)


@pytest.mark.slow
def test_engines_and_ranks_keep_to_a_node_on_a_group_spread_over_two(model, probes):
    """Two simulated nodes of 2 GPUs, a placement group of 4 bundles that Ray spreads over them (SPREAD: bundle i on
    node i % 2), --colocate_all's layout on it: each tensor-parallel engine's workers share a node, and actor rank i
    shares bundle (and node) with vLLM worker i."""
    from ray.util.placement_group import placement_group

    cluster = start_cluster(2, gpus=2, cpus=4)
    try:
        pg = placement_group([{"GPU": 1, "CPU": 1}] * 4, strategy="SPREAD")
        ray.get(pg.ready(), timeout=120)
        nodes = ray_workers.bundle_nodes(pg)
        assert len(set(nodes.values())) == 2
        actor = placement_probe.probe_group(None, pg, 0.2, 1, role="actor")
        engines = vllm_engine.create_vllm_engines(2, 2, model, 0, 64, placement_group=pg)
        ranks = ray.get(actor.call("report"), timeout=60)
        workers = [w for engine in engines for w in ray.get(engine.placement.remote(), timeout=60)]
    finally:
        stop_cluster(cluster)
    assert [len({w["node"] for w in workers[i:i + 2]}) for i in (0, 2)] == [1, 1], workers
    assert [r["node"] for r in ranks] == [w["node"] for w in workers]
    assert actor.bundles == [b for engine in ray_workers.tensor_parallel_bundles(nodes, 2, 2) for b in engine]
