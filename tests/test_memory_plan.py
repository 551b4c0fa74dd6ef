"""The memory pre-flight of ppo_ray.py (common/memory_plan.py) on the launch/ recipes, with Llama-3 configs.

tests/llama3_8b and tests/llama3_70b hold the config.json of Meta's Llama-3-8B and Llama-3-70B as published (no
weights): the plan is computed from them alone, so every recipe's layout is checked against 80 GiB GPUs here.
"""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from test_placement import distinct, recipe_layouts

import ppo_ray
from common import memory_plan
from common.args import UserError, parse_args

TESTS = os.path.dirname(os.path.abspath(__file__))
LLAMA = {"8B": os.path.join(TESTS, "llama3_8b"), "70B": os.path.join(TESTS, "llama3_70b")}


def recipe_args(name: str, flags: list[str], **changes) -> ppo_ray.Args:
    """The recipe's Args, its models standing in as the Llama-3 config its header names ("... of a 70B ...")."""
    with open(os.path.join(ROOT, "launch", name.split(" = ")[0])) as f:
        size = "70B" if "70B Llama" in f.read() else "8B"
    args = parse_args(ppo_ray.Args, [LLAMA[size] if "$" in w else w for w in flags])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


RECIPES = distinct(recipe_layouts())


def test_llama3_configs_give_the_published_sizes():
    sizes = {name: memory_plan.model_sizes(memory_plan.read_config(path, "--pretrain")) for name, path in
             LLAMA.items()}
    assert sizes["8B"]["causal_lm"] == 8_030_261_248 and sizes["70B"]["causal_lm"] == 70_553_706_496
    assert sizes["70B"]["kv_per_token"] == 327_680  # 80 layers x 8 KV heads x 128 x (k, v) x bf16


@pytest.mark.parametrize("name,nodes,flags", RECIPES, ids=[name for name, _, _ in RECIPES])
def test_every_recipe_fits_its_gpus(name, nodes, flags):
    args = recipe_args(name, flags)
    groups = memory_plan.plan(args)
    memory_plan.check(args, groups)
    assert sum(gpus for gpus, _ in groups.values()) == 8 * nodes, memory_plan.describe(args, groups)


def test_lora_plans_the_adapters_states_and_no_reference():
    """--lora_rank 16 on the 70B recipe: each actor GPU holds its bf16 shard of the frozen weights and the states of
    the adapters alone, and no reference model is planned (the actor with its adapters off is the reference)."""
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    full, lora = (memory_plan.plan(recipe_args(name, flags, **changes)) for changes in ({}, {"lora_rank": 16}))
    assert any("reference" in roles for _, roles in full.values())
    assert not any("reference" in roles for _, roles in lora.values())
    gpus, roles = lora["actor"]
    assert roles["actor"]["frozen weights"] == 2 * 70_553_706_496 // gpus
    assert roles["actor"]["model states"] < full["actor"][1]["actor"]["model states"] / 100
    # peft's count for rank 16 on every linear layer of Llama-3-8B
    assert 16 * memory_plan.model_sizes(memory_plan.read_config(LLAMA["8B"], "--pretrain"))["lora_per_rank"] \
        == 41_943_040


@pytest.mark.parametrize("changes,stored", [
    ({"gradient_checkpointing": False}, "turn on --gradient_checkpointing"),  # ~5.9 MB a token: 45 GiB more
    ({"zero_stage": 1, "colocate_actor_ref": True}, "give actor more workers"),  # whole-model fp32 gradients
])
def test_what_zero_3_and_checkpointing_save_is_counted(changes, stored):
    """The 8B recipe fits 80 GiB GPUs with ZeRO-3 and gradient checkpointing. Without checkpointing every layer's
    activations of a micro-batch of 4 x 2048 tokens stay for backward; at ZeRO-1 DeepSpeed keeps the gradients of the
    whole model in fp32 on every GPU. The plan once counted neither and accepted both layouts, which run out of
    memory."""
    name, _, flags = next(r for r in RECIPES if "8gpu" in r[0])
    args = recipe_args(name, flags, **changes)
    with pytest.raises(UserError, match=re.escape(stored)):
        memory_plan.check(args, memory_plan.plan(args))


def test_model_states_below_zero_2_are_not_split_as_zero_2_splits_them():
    """Bytes per parameter on 8 GPUs: ZeRO-2 splits gradients and Adam states (2 + 18/8, DeepSpeed's estimate);
    ZeRO-1 in bf16 keeps fp32 gradients whole (2 + 4 + 12/8); ZeRO-0's bf16 wrapper keeps everything whole (20)."""
    params = 8 * 10**9
    per_param = {stage: memory_plan.model_states(stage, params, 0, 8, False)[0] / params for stage in (0, 1, 2)}
    assert per_param[1] == 7.5 and per_param[0] == 20 and per_param[2] < per_param[1]


def test_the_old_70b_vllm_layout_is_refused_in_one_sentence():
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    args = recipe_args(name, flags, vllm_num_engines=2, vllm_tensor_parallel_size=2)
    with pytest.raises(UserError, match=r"^each vLLM GPU holds 65\.7 GiB of weights .* raise "
                                        r"--vllm_tensor_parallel_size or --vllm_gpu_memory_utilization\.$"):
        memory_plan.check(args, memory_plan.plan(args))


def test_engines_in_float32_hold_twice_the_bytes_per_weight_and_per_cached_token():
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    bf16, fp32 = (memory_plan.plan(recipe_args(name, flags, vllm_dtype=dtype))["vLLM"][1]["vLLM"]
                  for dtype in ("trainer", "float32"))
    assert fp32["weights"] == 2 * bf16["weights"]
    per_byte_of_cache = bf16["sequences"] / bf16["KV cache"]  # sequences a byte of bf16 KV cache holds
    left = bf16["KV cache"] - bf16["weights"]  # the weights' second half comes out of the cache
    assert fp32["sequences"] == pytest.approx(left * per_byte_of_cache / 2) and fp32["sequences"] < 0
    with pytest.raises(UserError, match=r"^each vLLM GPU holds 65\.7 GiB of weights"):  # 70B over 4 GPUs, in fp32
        memory_plan.check(recipe_args(name, flags, vllm_dtype="float32"), memory_plan.plan(
            recipe_args(name, flags, vllm_dtype="float32")))


def test_colocate_all_counts_the_engines_whole_share():
    """--colocate_all at vLLM's default 0.85: the engines need that much free when they start, beside the models."""
    name, _, flags = next(r for r in RECIPES if "8gpu" in r[0])
    args = recipe_args(name, flags, colocate_all=True, colocate_actor_ref=False, colocate_critic_reward=False,
                       actor_num_workers=8, vllm_num_engines=8)
    with pytest.raises(UserError, match=r"^the actor GPUs would hold .* lower the micro-batch sizes or "
                                        r"--vllm_gpu_memory_utilization, or colocate less\.$"):
        memory_plan.check(args, memory_plan.plan(args))


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_starts_nothing():
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    words = [LLAMA["70B"] if "$" in w else w for w in flags]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "ppo_ray.py"), *words, "--dry_run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vLLM GPUs x4" in result.stdout and "KV cache holds" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith("the plan fits."), result.stdout
