"""The memory pre-flight of ppo_ray.py (common/memory_plan.py) on the launch/ recipes, with Llama-3 configs.

tests/llama3_8b and tests/llama3_70b hold the config.json of Meta's Llama-3-8B and Llama-3-70B as published (no
weights): the plan is computed from them alone, so every recipe's layout is checked against 80 GiB GPUs here.
tests/idefics3_8b holds an Idefics3 config built with transformers' Idefics3Config from Llama-3-8B's text config and
SigLIP-so400m's vision sizes (hidden 1152, 27 layers, 364-pixel images in 14-pixel patches), the shapes of
Idefics3-8B-Llama3, and the preprocessor_config.json of transformers' Idefics3 image processor defaults (images
resized to a longest edge of 1456 pixels and cut into 364-pixel tiles): the vision-language recipe's stand-in.
"""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from test_placement import distinct, recipe_layouts

import ppo_ray
from common import memory_plan
from common.args import UserError, parse_args

TESTS = os.path.dirname(os.path.abspath(__file__))
LLAMA = {"8B": os.path.join(TESTS, "llama3_8b"), "70B": os.path.join(TESTS, "llama3_70b")}
MIXTRAL = os.path.join(TESTS, "mixtral_8x7b")  # Mixtral-8x7B's config.json as published (46.7B parameters)
IDEFICS3 = os.path.join(TESTS, "idefics3_8b")


def recipe_args(name: str, flags: list[str], **changes) -> ppo_ray.Args:
    """The recipe's Args, its models standing in as the config its header names ("... of a 70B ...", Idefics3)."""
    with open(os.path.join(ROOT, "launch", name.split(" = ")[0])) as f:
        header = f.read()
    model = IDEFICS3 if "Idefics3" in header else LLAMA["70B" if "70B Llama" in header else "8B"]
    args = parse_args(ppo_ray.Args, [model if "$" in w else w for w in flags])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


RECIPES = distinct(recipe_layouts())


def test_llama3_configs_give_the_published_sizes():
    sizes = {name: memory_plan.model_sizes(memory_plan.read_config(path, "--pretrain")) for name, path in
             LLAMA.items()}
    assert sizes["8B"]["params"] == 8_030_261_248 and sizes["70B"]["params"] == 70_553_706_496
    assert sizes["70B"]["kv_per_token"] == 327_680  # 80 layers x 8 KV heads x 128 x (k, v) x bf16


@pytest.mark.parametrize("name,nodes,flags", RECIPES, ids=[name for name, _, _ in RECIPES])
def test_every_recipe_fits_its_gpus(name, nodes, flags):
    args = recipe_args(name, flags)
    groups = memory_plan.plan(args)
    memory_plan.check(args, groups)
    assert sum(gpus for gpus, _ in groups.values()) == 8 * nodes, memory_plan.describe(args, groups)


def test_a_vision_language_policy_plans_its_tower_frozen_or_trained():
    """The Idefics3 recipe: with the tower frozen (the default) the actor holds its bf16 shard and no gradients or Adam
    states for it; trained, its states join the model's and its layers' inputs over one image a row, in tiles, the
    activations.
    The engines hold the whole model, tower included."""
    name, _, flags = next(r for r in RECIPES if "idefics3" in r[0])
    sizes = memory_plan.sizes_of(IDEFICS3, "--pretrain")
    assert sizes["params"] == 8_462_086_384 and sizes["vision_params"] == 412_926_192
    # 27 layers x 26 x 26 patches x (18 x 1152 + 8 x 4304) bytes a tile, and an image is cut (its processor's
    # preprocessor_config.json: longest edge 1456, tiles of 364) into up to 4 x 4 tiles plus the whole: 17
    assert sizes["activations_per_image"] == 17 * 27 * 676 * (18 * 1152 + 8 * 4304)
    frozen_args, trained_args = (recipe_args(name, flags, freeze_vision_tower=f) for f in (True, False))
    frozen, trained = (memory_plan.plan(a) for a in (frozen_args, trained_args))
    gpus, roles = frozen["actor"]
    assert roles["actor"]["frozen vision tower"] == 2 * 412_926_192 // gpus
    assert "frozen vision tower" not in trained["actor"][1]["actor"]
    assert trained["actor"][1]["actor"]["model states"] > roles["actor"]["model states"]
    assert trained["actor"][1]["actor"]["activations"] - roles["actor"]["activations"] == \
        frozen_args.micro_train_batch_size * sizes["activations_per_image"]
    assert frozen["vLLM"][1]["vLLM"]["weights"] == 2 * sizes["params"]
    memory_plan.check(frozen_args, frozen)


@pytest.mark.parametrize("settings, patches", [
    ({}, 676),  # no tiles: one image_size image
    ({"do_image_splitting": True, "size": {"longest_edge": 1820}, "max_image_size": {"longest_edge": 364}}, 26 * 676),
    ({"do_image_splitting": False, "size": {"longest_edge": 364}, "max_image_size": {"longest_edge": 364}}, 676),
    ({"max_pixels": 12845056, "min_pixels": 3136, "patch_size": 14, "temporal_patch_size": 2}, 65536),  # Qwen2-VL
    ({"size": {"longest_edge": 1003520, "shortest_edge": 3136}, "patch_size": 14, "temporal_patch_size": 2}, 5120),
], ids=["whole", "idefics3-5x5-tiles", "no-splitting", "qwen-max-pixels", "qwen-size"])
def test_an_image_counts_as_many_patches_as_its_processor_cuts_it_into(tmp_path, settings, patches):
    """A trained tower keeps its layers' inputs over every patch of an image as its processor cuts it: Idefics3's and
    SmolVLM's tiles plus the whole image, Qwen-VL's dynamic resolution up to max_pixels (in transformers' older and
    newer spellings); a 364-pixel image of 14-pixel patches is 26 x 26 = 676."""
    if settings:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    vision = SimpleNamespace(image_size=364, patch_size=14)
    assert memory_plan.patches_per_image(str(tmp_path), vision) == patches


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_qwen_vl_and_glm4v_towers_are_planned_by_their_own_names_and_patches(tmp_path, family):
    """These towers name their layers `depth`, and Qwen2-VL's its width `embed_dim` (its hidden_size is the merger's
    output): the plan read num_hidden_layers and stopped with an AttributeError on all four. An image counts the
    patches its processor allows (max_pixels / 14 x 14)."""
    from test_vlm_families import tiny_config

    config = tiny_config(family)
    config.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 112 * 112, "patch_size": 14,
                                                                    "temporal_patch_size": 2}))
    sizes = memory_plan.sizes_of(str(tmp_path), "--pretrain")
    vision = config.vision_config
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    intermediate = getattr(vision, "intermediate_size", None) or 4 * width
    assert sizes["activations_per_patch"] == vision.depth * (18 * width + 8 * intermediate)
    assert sizes["activations_per_image"] == 64 * sizes["activations_per_patch"]
    assert sizes["vision_params"] > 0


def test_a_vision_language_reward_model_or_critic_is_the_vlm_with_a_scalar_head_for_its_lm_head():
    """A VLM reward model or critic (common/vlm.py sequence_classification_class, which transformers has no class
    for) is planned as the VLM whose LM head (vocab x hidden) is a one-label score head (hidden), the tower counted."""
    config = memory_plan.read_config(IDEFICS3, "--reward_pretrain")
    policy, scalar = memory_plan.model_sizes(config), memory_plan.model_sizes(config, scalar_head=True)
    hidden = config.text_config.hidden_size
    assert scalar["params"] == policy["params"] - policy["vocab"] * hidden + hidden
    assert scalar["vision_params"] == policy["vision_params"] == 412_926_192


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


def test_zero_3_model_states_hold_the_bf16_weight_partition_too():
    """DeepSpeed's ZeRO-3 estimate counts 18 bytes a parameter (gradients, fp32 weights, Adam's moments) but not the
    bf16 partition the model computes from, which its ZeRO-2 estimate counts: an H100 peaked at 1.15x a plan that
    left it out (docs/gpu.md). Offloaded, the estimate already holds it."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    params, largest = 8 * 10**9, 10**9
    for gpus in (1, 8):
        _, estimate, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=gpus,
                                                               cpu_offload=False, cpu_offload_params=False)
        assert memory_plan.model_states(3, params, largest, gpus, offload=False)[0] == estimate + 2 * params // gpus
    _, offloaded, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=8, cpu_offload=True,
                                                            cpu_offload_params=False)
    assert memory_plan.model_states(3, params, largest, 8, offload=True)[0] == offloaded


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


def test_one_gpu_actor_is_planned_at_the_stage_it_gets_on_a_gpu():
    """A one-rank actor gets ZeRO-1 on a bf16 GPU (deepspeed_utils.trained_zero_stage); the plan took the stage from
    the machine making it, so --dry_run on a CPU login node planned ZeRO-0's 20 bytes a parameter (Phi-3-mini:
    71.2 GiB where stage 1 needs 64.1) and could refuse a layout that fits."""
    args = parse_args(ppo_ray.Args, ["--pretrain", LLAMA["8B"], "--actor_num_workers", "1"])
    sizes = memory_plan.model_sizes(memory_plan.read_config(LLAMA["8B"], "--pretrain"))
    planned = memory_plan.plan(args)["actor"][1]["actor"]["model states"]
    assert planned == memory_plan.model_states(1, sizes["params"], sizes["largest_layer"], 1, False)[0]


def bnb_4bit_params(model) -> int | None:
    """Parameters bitsandbytes itself turns into Linear4bit (transformers' replace_with_bnb_linear), or None where
    bitsandbytes is not installed."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    replace_with_bnb_linear(model, get_keys_to_not_convert(model), BitsAndBytesConfig(load_in_4bit=True))
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


def test_qlora_keeps_a_mixture_of_experts_fused_experts_in_bf16():
    """bitsandbytes quantizes nn.Linear modules only, and transformers 5 keeps Mixtral's experts as fused tensors of
    no nn.Linear: of Mixtral-8x7B's 46.7B parameters only the attention projections (32 layers x (2 x 4096 x 4096 +
    2 x 4096 x 1024)) become 4-bit. The plan counted every non-embedding parameter at 4 bits ("frozen weights 22.1
    GiB, the plan fits") while 84 GiB stay bf16, which no 80 GB GPU loads."""
    from transformers import AutoModelForCausalLM

    attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    sizes = memory_plan.model_sizes(memory_plan.read_config(MIXTRAL, "--pretrain"))
    assert sizes["params"] == 46_702_792_704 and sizes["quantized_4bit"] == attention
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(memory_plan.read_config(MIXTRAL, "--pretrain"))
    assert bnb_4bit_params(model) in (None, attention)
    args = parse_args(ppo_ray.Args, ["--pretrain", MIXTRAL, "--lora_rank", "16", "--load_in_4bit",
                                     "--actor_num_workers", "1", "--advantage_estimator", "grpo",
                                     "--vllm_tensor_parallel_size", "4"])
    groups = memory_plan.plan(args)
    frozen = groups["actor"][1]["actor"]["frozen weights"]
    assert frozen == attention // 2 + 2 * (sizes["params"] - attention) and frozen > 84 * memory_plan.GiB
    with pytest.raises(UserError, match=r"^the actor GPUs would hold"):
        memory_plan.check(args, groups)
    # a dense model is 4-bit but for its embeddings, LM head and norms: Llama-3-8B's 2 x 128256 x 4096 + 65 x 4096
    llama = memory_plan.model_sizes(memory_plan.read_config(LLAMA["8B"], "--pretrain"))
    assert llama["params"] - llama["quantized_4bit"] == 2 * 128256 * 4096 + 65 * 4096


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_starts_nothing():
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    words = [LLAMA["70B"] if "$" in w else w for w in flags]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "ppo_ray.py"), *words, "--dry_run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "vLLM GPUs x4" in result.stdout and "KV cache holds" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith("the plan fits."), result.stdout


# ------------------------------------------------------------------------------------------------ model families
TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # head_dim 8


def families() -> dict:
    """Configs of each shape the plan reads, built with transformers' config classes: GPT-2 and OPT at their published
    sizes (124,439,808 and 125,239,296 parameters, tied), a Gemma-3 vision-language model whose language model is
    under text_config, a Llama, and two mixtures of experts whose expert weights are most of the model."""
    from transformers import (Gemma3Config, GPT2Config, LlamaConfig, MixtralConfig, OPTConfig, Qwen2MoeConfig,
                              SiglipVisionConfig)

    return {
        "gpt2": GPT2Config(),
        "opt": OPTConfig(),
        "gemma3": Gemma3Config(text_config={**TINY, "head_dim": 16, "intermediate_size": 48, "sliding_window": 16},
                               vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=48,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                image_size=28, patch_size=14).to_dict(),
                               mm_tokens_per_image=4),
        "llama": LlamaConfig(**TINY, intermediate_size=48),
        "mixtral": MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**TINY, intermediate_size=40, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2),
    }


def hand_count(name: str) -> int | None:
    """Parameters of the tiny models counted by hand: embedding and LM head (untied), per layer attention (q, k, v, o;
    Qwen2-MoE's q/k/v biases), the router, every expert's gate/up/down, Qwen2-MoE's shared expert and its gate, two
    norms; a final norm."""
    v, h, layers, heads, kv, d = 64, 32, 2, 4, 2, 8
    attention = 2 * h * heads * d + 2 * h * kv * d
    if name == "mixtral":
        layer = attention + h * 4 + 4 * 3 * h * 48 + 2 * h
    elif name == "qwen2_moe":
        layer = attention + (heads + 2 * kv) * d + h * 4 + 4 * 3 * h * 16 + 3 * h * 24 + h + 2 * h
    else:
        return None
    return 2 * v * h + layers * layer + h


PUBLISHED = {"gpt2": 124_439_808, "opt": 125_239_296}


@pytest.mark.parametrize("name", ["gpt2", "opt", "gemma3", "llama", "mixtral", "qwen2_moe"])
def test_the_plan_reads_every_family_through_its_config_class(name, tmp_path):
    """The plan read config.json's own keys (hidden_size, intermediate_size, ...): GPT-2 (n_embd), OPT (ffn_dim) and
    Gemma 3 (under text_config) stopped the first GPU run with a KeyError, and a mixture of experts was counted as
    one dense MLP. Each family here is planned as a PPO run with a critic and a reward model of its own kind."""
    families()[name].save_pretrained(tmp_path)
    args = parse_args(ppo_ray.Args, ["--pretrain", str(tmp_path), "--reward_pretrain", str(tmp_path),
                                     "--advantage_estimator", "gae"])
    groups = memory_plan.plan(args)
    memory_plan.check(args, groups)
    assert {"actor", "reference", "critic", "reward model 1", "vLLM"} <= {r for _, roles in groups.values()
                                                                          for r in roles}
    expected = PUBLISHED.get(name) or hand_count(name)
    if expected:
        assert groups["vLLM"][1]["vLLM"]["weights"] == 2 * expected  # bf16, every expert included
    sizes = memory_plan.model_sizes(memory_plan.read_config(str(tmp_path), "--pretrain"))
    assert groups["vLLM"][1]["vLLM"]["weights"] == 2 * sizes["params"]
    text = families()[name].get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    assert sizes["kv_per_token"] == 2 * text.num_hidden_layers * kv_heads * head_dim * 2


def test_experts_are_counted_whole_and_a_token_s_activations_at_its_top_k():
    """Mixtral keeps all 4 experts of a layer (each 3 x 32 x 48) in memory and gathers the layer whole under ZeRO-3;
    a token goes through 2 of them, and through Qwen2-MoE's shared expert too."""
    configs = families()
    mixtral = memory_plan.model_sizes(configs["mixtral"])
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 32 * 4 + 4 * 3 * 32 * 48 + 2 * 32
    assert mixtral["largest_layer"] == layer
    assert memory_plan.mlp_width(configs["mixtral"]) == 2 * 48
    assert memory_plan.mlp_width(configs["qwen2_moe"]) == 2 * 16 + 24
    critic = memory_plan.model_sizes(configs["mixtral"], scalar_head=True)  # a one-output head for the LM head
    assert critic["params"] == mixtral["params"] - 64 * 32 + 32


def test_routing_replay_counts_the_routes_each_token_carries():
    """Mixtral-8x7B: 32 MoE layers x 2 experts a token, an int16 each; on the actor's micro-batch, only with the
    flag, and nothing for a dense model."""
    assert memory_plan.model_sizes(memory_plan.read_config(MIXTRAL, "--pretrain"))["routes_per_token"] == 32 * 2 * 2
    assert memory_plan.model_sizes(memory_plan.read_config(LLAMA["8B"], "--pretrain"))["routes_per_token"] == 0
    flags = ["--pretrain", MIXTRAL, "--advantage_estimator", "grpo", "--vllm_tensor_parallel_size", "4",
             "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8"]
    args = parse_args(ppo_ray.Args, flags)
    assert memory_plan.plan(args)["actor"][1]["actor"]["routes"] == 0
    args = parse_args(ppo_ray.Args, [*flags, "--routing_replay"])
    assert memory_plan.plan(args)["actor"][1]["actor"]["routes"] == 8 * (256 + 64) * 128


def test_gemma3_plans_its_language_model_and_counts_its_vision_tower(tmp_path):
    """transformers loads Gemma 3 as a causal LM with its vision tower (Gemma3ForConditionalGeneration): every
    weight counts, while the KV cache and activations are the language model's."""
    from transformers import AutoModelForCausalLM

    config = families()["gemma3"]
    sizes = memory_plan.model_sizes(config)
    with torch.device("meta"):
        text_only = sum(p.numel() for p in AutoModelForCausalLM.from_config(config.text_config).parameters())
    assert sizes["params"] > text_only
    assert sizes["kv_per_token"] == 2 * 2 * 2 * 16 * 2 and sizes["vocab"] == config.text_config.vocab_size


def unknown_model(folder) -> str:
    """A model folder whose code transformers does not have (its own modelling code, run with trust_remote_code)."""
    (folder / "config.json").write_text(json.dumps({"model_type": "my_own_lm", "hidden_size": 64, "auto_map": {
        "AutoModelForCausalLM": "modeling_my_own.MyOwnForCausalLM"}}))
    return str(folder)


def test_a_model_of_unknown_shape_skips_the_plan_in_one_line(tmp_path, capsys, monkeypatch):
    """Remote code, or a config without a shape the plan needs (a Mamba has no attention heads), skips the plan with a
    line saying why, in --dry_run and before a GPU start, instead of stopping the run."""
    from transformers import MambaConfig

    (tmp_path / "mamba").mkdir()
    MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2).save_pretrained(tmp_path / "mamba")
    for folder, why in [(unknown_model(tmp_path), r" is a 'my_own_lm' model, which transformers \S+ does not know "
                                                  r"\(remote code is not run here\), so its sizes are unknown\.$"),
                        (str(tmp_path / "mamba"), r": its config names no num_attention_heads, a shape the plan "
                                                  r"needs\.$")]:
        args = parse_args(ppo_ray.Args, ["--pretrain", folder])
        memory_plan.dry_run(args)
        out = capsys.readouterr().out.strip()
        assert re.match(rf"^memory plan skipped: --pretrain {re.escape(folder)}{why}", out), out
        memory_plan.preflight(args)
        assert capsys.readouterr().out.startswith("memory plan skipped: ")


@pytest.mark.parametrize("coef,estimator,reference", [(0.0, "grpo", False), (0.0, "dr_grpo", False),
                                                      (0.001, "grpo", True), (0.05, "gae", True), (0.0, "gae", False)])
def test_the_plan_counts_a_reference_exactly_when_ppo_ray_starts_one(coef, estimator, reference):
    """The plan added a reference for GRPO and Dr. GRPO at --init_kl_coef 0, which ppo_ray.py never starts: a 70B
    Dr. GRPO or DAPO run (beta 0) was refused for memory it would not use. Both now ask one predicate."""
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    args = recipe_args(name, flags, init_kl_coef=coef, advantage_estimator=estimator, colocate_actor_ref=False)
    planned = any("reference" in roles for _, roles in memory_plan.plan(args).values())
    assert planned == reference == ppo_ray.uses_reference(args)
    assert ppo_ray.uses_reference is memory_plan.uses_reference


@pytest.mark.parametrize("colocate", [False, True])
def test_the_plan_counts_a_teacher_where_it_is_placed(colocate):
    """--teacher_pretrain's frozen teacher is placed as the reference is: on workers of its own, or beside the actor
    with --colocate_actor_ref, where its weights add to the actor's GPUs."""
    name, _, flags = next(r for r in RECIPES if "70b" in r[0])
    args = recipe_args(name, flags, colocate_actor_ref=colocate)
    without = memory_plan.plan(args)
    args.teacher_pretrain = args.pretrain
    groups = memory_plan.plan(args)
    assert set(groups) - set(without) == (set() if colocate else {"teacher"})
    assert "teacher" in groups["actor" if colocate else "teacher"][1]


def test_the_printed_plan_says_what_lies_outside_the_gpus():
    """--agent_fn's endpoint serves from the driver, outside the plan; --partial_rollouts keeps --max_staleness
    steps' samples under way, which the printed plan sets against the KV cache's room."""
    name, _, flags = next(r for r in RECIPES if "8gpu" in r[0])
    plain = recipe_args(name, flags)
    assert "driver" not in memory_plan.describe(plain, memory_plan.plan(plain))
    agents = recipe_args(name, flags, agent_fn="agent.py:run_agent")
    assert "driver (no GPU): --agent_fn's OpenAI-compatible endpoint" in memory_plan.describe(
        agents, memory_plan.plan(agents))
    partial = recipe_args(name, flags, async_rollouts=True, partial_rollouts=True, max_staleness=2)
    groups = memory_plan.plan(partial)
    per_engine = 2 * partial.rollout_batch_size * partial.n_samples_per_prompt / partial.vllm_num_engines
    room = groups["vLLM"][1]["vLLM"]["sequences"]
    assert (f"--partial_rollouts: up to {per_engine:.0f} samples under way per engine, against KV cache for "
            f"{room:.0f} of full length") in memory_plan.describe(partial, groups)
