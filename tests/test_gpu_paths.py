"""Small decisions of the GPU path, checked on CPU: what a first GPU run would otherwise find out the hard way.

- the entropy bonus builds no autograd graph at --entropy_coef 0 (two fp32 batch x seq x vocab tensors kept for a
  backward that never uses them);
- flash-attention only in bf16/fp16, where its kernels run;
- the experience phase's forwards run at --micro_rollout_batch_size, not the training micro-batch;
- under `deepspeed ppo_ray.py` only the process of RANK 0 drives; the others exit 0 with one line;
- the weight-sync group leaves out a vLLM worker on the trainer's own GPU, which takes CUDA IPC handles instead;
- --packing_samples is refused on a GPU without flash-attention 2 (a dense mask over the whole packed row);
- `make gpu-smoke`'s stages use flags the scripts take, together.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

import ppo_ray
from common import deepspeed_utils, memory_plan, placement
from common.model_worker import train_or_eval_config


class CountingLM(torch.nn.Module):
    """A causal LM stand-in: logits from one trainable embedding; counts its forward passes."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, vocab)
        self.forwards = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        self.forwards += 1
        return SimpleNamespace(logits=self.embed(input_ids))  # (batch, seq, vocab)


def policy_worker(**flags) -> ppo_ray.ActorWorker:
    worker = ppo_ray.ActorWorker()  # a plain class until ray.remote wraps it; setup() would load a model
    worker.args, worker.engine = ppo_ray.Args(**flags), CountingLM()
    return worker


def batch(rows: int = 8, seq: int = 6) -> dict:
    ids = torch.randint(0, 11, (rows, seq))
    mask = torch.ones(rows, seq, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
            "action_mask": torch.ones(rows, seq - 1)}


@pytest.mark.parametrize("coef,graph", [(0.0, False), (0.01, True)])
def test_entropy_builds_a_graph_only_when_it_is_in_the_loss(coef, graph):
    logprobs, entropy = policy_worker(entropy_coef=coef)._logprobs(batch(), with_entropy=True)
    assert logprobs.requires_grad  # the policy loss still trains
    assert entropy.requires_grad == graph
    assert entropy.shape == logprobs.shape and (entropy > 0).all()  # still logged as objective/entropy


def test_flash_attention_only_in_half_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(deepspeed_utils, "_has_flash_attn", lambda: True)
    assert deepspeed_utils.attention_implementation(torch.bfloat16) == "flash_attention_2"
    assert deepspeed_utils.attention_implementation(torch.float16) == "flash_attention_2"
    assert deepspeed_utils.attention_implementation(torch.float32) == "sdpa"  # e.g. a V100: no bf16, fp32 model
    monkeypatch.setattr(deepspeed_utils, "_has_flash_attn", lambda: False)
    assert deepspeed_utils.attention_implementation(torch.bfloat16) == "sdpa"


def test_bf16_only_where_the_gpu_computes_in_it(monkeypatch):
    """torch calls a V100 or T4 bf16-capable by emulation; bf16 there, with flash-attention, failed at the first
    forward ("FlashAttention only supports Ampere GPUs or newer")."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(
        including_emulation) or including_emulation)  # a pre-Ampere GPU: by emulation only
    assert not deepspeed_utils.use_bf16() and asked == [False]


@pytest.mark.parametrize("capability, dtype", [(70, "float32"), (75, "float32"), (80, "bfloat16"), (90, "bfloat16")])
def test_vllm_generates_in_the_trainers_precision(monkeypatch, capability, dtype):
    """vLLM's dtype "auto" kept a float16 checkpoint (Llama-2, Pythia) in float16 while the trainers computed in
    bfloat16, and on a V100 or T4 generated in float16 against fp32 trainers: the engines now take the trainers'."""
    from vllm.platforms import current_platform

    from common.vllm_engine import trainer_dtype
    monkeypatch.setattr(current_platform, "has_device_capability", lambda asked, device_id=0: capability >= asked)
    assert trainer_dtype(use_gpu=True) == dtype
    assert trainer_dtype(use_gpu=False) == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the trainers' own rule agrees
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= 80)
    assert deepspeed_utils.use_bf16() == (dtype == "bfloat16")


def test_bf16_gradients_accumulate_in_fp32(monkeypatch):
    """DeepSpeed accumulates micro-batches' gradients in the model's dtype unless told otherwise: in bf16, over the
    8 micro-batches of the 8B PPO layout, the small ones' share of the sum was lost. Stage 0 cannot accumulate in
    fp32 (DeepSpeed raises), so a one-rank role in bf16 gets stage 1; --offload_optimizer with --zero_stage 0 built
    the CPU optimizer for GPU parameters."""
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: True)
    for stage in (1, 2, 3):
        assert deepspeed_utils.ds_config(stage, 32, 4, 1)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_utils.ds_config(0, 32, 4, 1)
    assert "data_types" not in deepspeed_utils.ds_config(3, 32, 4, 1, train=False)  # a frozen model: no gradients
    assert deepspeed_utils.trained_zero_stage(None, 1) == 1
    assert deepspeed_utils.trained_zero_stage(None, 4) == 3 and deepspeed_utils.trained_zero_stage(0, 1) == 0
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: False)  # CPU: fp32, nothing to ask
    assert deepspeed_utils.trained_zero_stage(None, 1) == 0
    assert "data_types" not in deepspeed_utils.ds_config(3, 8, 4, 1)
    with pytest.raises(deepspeed_utils.UserError, match="--offload_optimizer keeps the optimizer's state in CPU "
                                                        "memory, which ZeRO does from stage 1 up"):
        deepspeed_utils.ds_config(0, 32, 4, 1, offload_optimizer=True)


@pytest.mark.parametrize("script", ["sft", "rm", "dpo", "kto"])
def test_a_trainer_on_one_rank_skips_zero3_unless_asked(script, tiny_model, task, tmp_path, monkeypatch):
    """sft/rm/dpo/kto defaulted to ZeRO-3 on any number of ranks. On one GPU stage 3 partitions nothing, and its
    hooks made an SFT step of a 0.9B model on an H100 take 1.7x stage 1's (bench/bench_sft_gpu.py): one rank now gets
    stage 1 in bf16, offloading the weights (which only stage 3 does) keeps 3, an explicit --zero_stage wins, and
    --offload_params at another stage is refused rather than silently ignored. Read where the run would form its
    distributed world, as a GPU run would see it."""
    import importlib

    from test_bad_inputs import command

    from common.args import parse_args

    trainer = importlib.import_module(script)
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: True)

    class Formed(Exception):
        pass

    def formed():
        raise Formed

    monkeypatch.setattr(trainer, "init_distributed", formed)
    stages = {}
    for name, flags in {"default": [], "asked": ["--zero_stage", "2"], "offloaded": ["--offload_params"]}.items():
        args = parse_args(trainer.Args, command(script, tiny_model, task, str(tmp_path / name), *flags))
        with pytest.raises(Formed):
            trainer.main(args)
        stages[name] = args.zero_stage
    assert stages == {"default": 1, "asked": 2, "offloaded": 3}
    with pytest.raises(deepspeed_utils.UserError, match="--offload_params keeps the weights in CPU memory between "
                                                        "their uses, which only ZeRO-3 does"):
        deepspeed_utils.ds_config(2, 32, 4, 1, offload_params=True)


def test_experience_forwards_use_the_rollout_micro_batch():
    worker = policy_worker(micro_train_batch_size=2, micro_rollout_batch_size=4)
    assert worker.logprobs(batch(rows=8)).shape == (8, 5)
    assert worker.engine.forwards == 2
    worker = policy_worker(micro_train_batch_size=2)  # unset: the training micro-batch, as before
    worker.logprobs(batch(rows=8))
    assert worker.engine.forwards == 4
    frozen = train_or_eval_config(ppo_ray.Args(micro_train_batch_size=1, micro_rollout_batch_size=4), 2, False)
    assert frozen["train_micro_batch_size_per_gpu"] == 4


def test_only_rank_zero_of_a_launcher_drives(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    assert not ppo_ray.drives_the_run()
    out = capsys.readouterr().out.splitlines()
    assert out == ["ppo_ray.py: launcher rank 3 exits; the process of rank 0 drives the run, Ray starts the workers."]
    for key in placement.LAUNCHER_VARIABLES:
        monkeypatch.setenv(key, "0" if "RANK" in key else "2")
    assert ppo_ray.drives_the_run()
    assert not any(key in os.environ for key in placement.LAUNCHER_VARIABLES)  # Ray's workers must not inherit them
    assert ppo_ray.drives_the_run()  # plain `python ppo_ray.py`: no RANK at all


def test_an_mpi_or_slurm_launch_is_not_taken_for_a_world_of_one(monkeypatch):
    """`deepspeed --launcher openmpi|slurm` (mpirun, srun) sets no RANK: init_distributed filled in a world of one,
    and every process trained alone, wrote the same checkpoints, and ppo_ray.py started one driver per process."""
    for key in ("RANK", *(name for pair in deepspeed_utils.MPI_SIZE_AND_RANK_VARS for name in pair)):
        monkeypatch.delenv(key, raising=False)
    assert deepspeed_utils.mpi_launch() == (1, 0)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # plain `python` in a SLURM job: a world of one
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert deepspeed_utils.mpi_launch() == (1, 0)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert deepspeed_utils.mpi_launch() == (4, 2)
    assert not ppo_ray.drives_the_run()
    monkeypatch.setattr(deepspeed_utils.importlib.util, "find_spec", lambda name: None)  # no mpi4py
    with pytest.raises(deepspeed_utils.UserError, match="one of 4 started by an MPI or SLURM launcher, which sets no "
                                                        "RANK: DeepSpeed finds the ranks through mpi4py"):
        deepspeed_utils.init_distributed()
    assert "RANK" not in os.environ


@pytest.mark.slow
def test_deepspeed_launcher_on_a_two_gpu_host_starts_one_driver(tmp_path):
    """`deepspeed --num_gpus 2 ppo_ray.py` with a flag mistake: rank 1 leaves with its line and exit code 0 (which the
    launcher lets pass), rank 0 alone drives and reports the mistake once."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", os.path.join(ROOT, "ppo_ray.py"),
           "--pretrain", str(tmp_path), "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert "ppo_ray.py: launcher rank 1 exits; the process of rank 0 drives the run" in output, output[-3000:]
    assert output.count("error: no reward source") == 1, output[-3000:]
    assert result.returncode == 2, output[-3000:]


@pytest.mark.parametrize("transports,tp_sizes,ranks,size", [
    (["gloo", "gloo"], [1, 1], [[1], [2]], 3),                      # CPU, engines on other hosts
    (["shm", "gloo"], [1, 1], [[None], [1]], 2),                     # CPU, one engine on the trainer's host
    (["ipc", "nccl", "nccl", "nccl"], [1, 1, 1, 1], [[None], [1], [2], [3]], 4),  # --colocate_all, 4 GPUs
    (["ipc", "nccl", "nccl", "nccl"], [2, 2], [[None, 1], [2, 3]], 4),  # --colocate_all, tensor parallel 2
    (["ipc"], [1], [[None]], 1),                                     # one GPU for everything: no group at all
])
def test_weight_sync_group_leaves_out_the_workers_on_the_trainers_gpu(transports, tp_sizes, ranks, size):
    from common.weight_sync import group_ranks

    assert group_ranks(transports, tp_sizes) == (ranks, size)


def test_cpu_workers_on_the_trainers_host_get_shared_memory_and_others_gloo():
    from common.weight_sync import plan_transports

    workers = [{"node": "a", "gpu": None}, {"node": "b", "gpu": None}, {"node": "a", "gpu": None}]
    assert plan_transports({"node": "a", "gpu": None}, workers) == ["shm", "gloo", "shm"]


def test_the_transport_follows_the_gpu_a_vllm_worker_computes_on_not_its_bundle_s_ray_id():
    """--colocate_all, one engine at tensor parallel 2 on bundles whose Ray GPU ids come in the order 1, 0: trainer
    rank 0 sits on bundle 0, GPU 1. vLLM's Ray executor gives tensor-parallel rank r of a node the r-th of its
    workers' sorted ids (placement_probe.vllm_devices), so rank 0 computes on GPU 0 and rank 1 on the trainer's GPU 1.
    The plan compared Ray ids: CUDA IPC to rank 0, which cannot map the trainer's memory, and NCCL to rank 1, which
    NCCL refuses on the trainer's own device. It compares the GPUs' UUIDs now, as vLLM's ipc_engine.py does."""
    from placement_probe import simulated_uuid, vllm_devices

    from common.weight_sync import group_ranks, plan_transports

    trainer = {"node": "n", "gpu_ids": ["1"], "gpu": simulated_uuid("n", "1")}
    workers = vllm_devices([{"node": "n", "gpu_ids": ["1"]}, {"node": "n", "gpu_ids": ["0"]}])
    assert [w["gpu"] for w in workers] == [simulated_uuid("n", "0"), simulated_uuid("n", "1")]
    assert plan_transports(trainer, workers) == ["nccl", "ipc"]
    assert group_ranks(["nccl", "ipc"], [2]) == ([[1, None]], 2)


@pytest.mark.parametrize("gpus,flash_attn", [(1, False), (2, True)])
def test_gpu_smoke_commands_use_flags_the_scripts_have(gpus, flash_attn):
    """`make gpu-smoke` runs on the first GPU machine, where a misspelt flag would be found too late. Stages needing
    2 GPUs, or flash-attn for packing, are left out with a sentence each on a machine without them."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import gpu_smoke

    from test_launch import parser_for

    stages = dict(gpu_smoke.commands("/out", gpus, flash_attn))
    two_gpus = {"ppo", "ppo_tp2", "ppo_async"}
    assert two_gpus & set(stages) == (two_gpus if gpus >= 2 else set())
    assert ("ppo_packing" in stages) == flash_attn
    assert {"ppo_all", "ppo_critic", "ppo_lora", "ppo_qlora", "ppo_moe", "rm"} <= set(stages)
    assert "--colocate_all" in stages["ppo_all"] and "--load_in_4bit" in stages["ppo_qlora"]
    assert stages["base_moe"][stages["base_moe"].index("--architecture") + 1] == "mixtral"
    skipped = gpu_smoke.skipped(gpus, flash_attn)
    assert len(skipped) == len(gpu_smoke.commands("/out", 2, True)) - len(stages)
    assert all(line.endswith(".") and " skipped: " in line for line in skipped), skipped
    for stage, cmd in stages.items():
        script = next((w[:-3] for w in cmd if w.endswith(".py")), None)
        if script is None:  # python -m common.tiny_model / common.synthetic_task
            continue
        flags = cmd[cmd.index(script + ".py") + 1:]
        parser_for(script).parse_args(flags)  # exits, failing the test, on a flag or value the script refuses


def test_gpu_smoke_ppo_stages_pass_ppo_ray_s_flag_checks(tmp_path):
    """Each PPO stage's flags together: ppo_ray.check_args (e.g. --async_rollouts refuses --colocate_all) and the
    placement's own rule for --colocate_all, with folders standing in for the models the earlier stages write."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import gpu_smoke

    from common.args import parse_args

    out = tmp_path / "smoke"
    tiny = {"max_position_embeddings": 2048, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}
    for folder, model_type in (("sft", "llama"), ("rm", "llama"), ("base_moe", "mixtral")):
        (out / folder).mkdir(parents=True)
        (out / folder / "config.json").write_text(json.dumps({"model_type": model_type, **tiny}))
    (out / "task").mkdir()
    (out / "task" / "prompts_train.jsonl").write_text('{"prompt": "1 + 1"}\n')
    for stage, cmd in gpu_smoke.commands(str(out), 2, True):
        if "ppo_ray.py" not in cmd:
            assert gpu_smoke.planned_gib(cmd, 80) is None, stage
            continue
        args = parse_args(ppo_ray.Args, cmd[cmd.index("ppo_ray.py") + 1:])
        ppo_ray.check_args(args)
        # the table's plan column: the busiest GPU of the plan, for this GPU's memory
        busiest = max(sum(memory_plan.gpu_bytes(need) for need in roles.values())
                      for _, roles in memory_plan.plan(args).values())
        assert gpu_smoke.planned_gib(cmd, args.gpu_memory_gib) == busiest / 2**30 > 0, stage
        assert not args.colocate_all or args.vllm_num_engines * args.vllm_tensor_parallel_size == \
            args.actor_num_workers, stage
        assert args.vllm_tensor_parallel_size == (2 if stage == "ppo_tp2" else 1)
        assert (args.advantage_estimator == "gae") == (stage == "ppo_critic") and bool(args.reward_pretrain) == (
            stage == "ppo_critic")


def smoke_rows(diffs: list[float]) -> list[dict]:
    """metrics.jsonl rows of a PPO run whose steps logged these vllm/logprob_diff values (and an eval row)."""
    return [{"step": i + 1, "vllm/logprob_diff": d} for i, d in enumerate(diffs)] + [{"step": len(diffs)}]


@pytest.mark.parametrize("stage,diffs,failed_steps", [
    ("ppo", [8e-3, 9e-3, 1.1e-2], []),         # bf16 rounding on both sides, the same after each sync
    ("ppo", [1e-6, 4e-3, 6e-3], [2, 3]),       # the engines kept the weights of step 1
    ("ppo", [1e-6, 1e-6, 3e-3], [3]),          # a later sync loaded nothing
    ("ppo_async", [1e-6, 4e-3, 6e-3], []),     # one update old by design from step 2
])
def test_gpu_smoke_fails_a_ppo_stage_whose_engines_missed_a_sync(stage, diffs, failed_steps):
    """`make gpu-smoke` passed every stage that exited with 0, so a sync that loaded wrong weights passed too. Each
    PPO stage now fails when a step's vllm/logprob_diff exceeds step 1's (where both sides loaded the checkpoint from
    disk) by more than gpu_smoke.SYNC_SLACK; tests/test_ppo.py applies the same check to real CPU runs."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import gpu_smoke

    failure = gpu_smoke.check_sync(stage, smoke_rows(diffs))
    assert (failure is None) == (not failed_steps), failure
    if failed_steps:
        head, listed = failure.split(": ", 1)
        assert head == "vLLM's log-probs differ from the trainer's after a sync", failure
        assert [int(part.split()[1]) for part in listed.split(" (step 1")[0].split(", ")] == failed_steps, failure
    assert gpu_smoke.check_sync("ppo", [{"step": 1}]) == "no step logged vllm/logprob_diff"
    table = gpu_smoke.table([{"stage": stage, "seconds": 12.3, "peak": 5.25, "plan": 6.0, "diffs": diffs,
                              "result": "ok" if not failed_steps else "FAILED"}])
    header, line = table.splitlines()
    assert header.split()[:4] == ["stage", "seconds", "peak", "GiB"] and line.split()[:4] == [stage, "12", "5.2",
                                                                                               "6.0"]
    assert f"{diffs[0]:.1e} -> {max(diffs[1:]):.1e}" in line


def llama_folder(folder) -> str:
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return str(folder)


def test_packing_on_a_gpu_without_flash_attention_is_refused(tmp_path, monkeypatch):
    """transformers 5.19 masks a packed row under sdpa with one dense (tokens x tokens) mask
    (masking_utils.packed_sequence_mask_function): on a GPU without flash-attn, --packing_samples was a slowdown.
    It is refused there in one sentence; on CPU, and on a GPU that runs flash-attention 2, packing goes on."""
    from common.args import UserError, check_packing

    model = llama_folder(tmp_path)
    check_packing(model, cuda=False, attention="sdpa")
    check_packing(model, cuda=True, attention="flash_attention_2")
    refusal = (r"^--packing_samples on a CUDA GPU needs flash-attention 2, and the models would load with sdpa, .* "
               r"install flash-attn .* or leave out --packing_samples\.$")
    with pytest.raises(UserError, match=refusal):
        check_packing(model, cuda=True, attention="sdpa")
    # what this process finds: a bf16 GPU, and flash-attn missing, then installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: True)
    monkeypatch.setattr(deepspeed_utils, "_has_flash_attn", lambda: False)
    with pytest.raises(UserError, match=refusal):
        check_packing(model)
    monkeypatch.setattr(deepspeed_utils, "_has_flash_attn", lambda: True)
    check_packing(model)
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: False)  # a V100: fp32 models, where flash-attn cannot run
    with pytest.raises(UserError, match=refusal):
        check_packing(model)


@pytest.mark.parametrize("role,flag,refused", [("actor", None, True), ("critic", "--critic_pretrain", True),
                                                ("reward model", "--reward_pretrain", False)])
def test_packing_is_refused_by_the_gpu_workers_that_would_pack(role, flag, refused, tmp_path, monkeypatch):
    """With --ray_address from a CPU head node, the driver's check saw no CUDA and let packing through, and GPU
    workers without flash-attn packed under sdpa's dense mask. Each worker that packs (actor, reference, critic)
    checks again in setup, with its own CUDA and flash-attn, before it joins its world or loads anything; the reward
    models score padded rows. The worker is built here as a plain object in this process, where CUDA is faked."""
    from common.args import UserError
    from common.model_worker import ModelWorker

    model = llama_folder(tmp_path)
    args = SimpleNamespace(packing_samples=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(deepspeed_utils, "use_bf16", lambda: True)
    monkeypatch.setattr(deepspeed_utils, "_has_flash_attn", lambda: False)

    def join_world():  # past the check: the worker would join its world now
        raise RuntimeError("joined")

    monkeypatch.setattr("common.model_worker.init_distributed", join_world)
    with pytest.raises(UserError if refused else RuntimeError,
                       match=r"^--packing_samples on a CUDA GPU needs flash-attention 2" if refused else "joined"):
        ModelWorker().setup(args, model, 1 if role != "reward model" else None, scalar_head_flag=flag)
