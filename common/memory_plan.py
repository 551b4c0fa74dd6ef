"""Memory pre-flight of a ppo_ray.py layout: what each GPU will hold, from the models' config.json alone.

Each model is built from its config on the meta device (no memory, no weights), so its parameters are counted as
transformers makes them, every expert of a mixture of experts included; its shapes come through AutoConfig, whose
attribute maps read GPT-2's n_embd as hidden_size, and a vision-language model's from its text config. A model whose
sizes cannot be known this way (remote code, a shape no attribute names) skips the plan, saying why in one line.

Trained roles (actor, critic) hold their model states (weights, gradients and Adam states): DeepSpeed's own
estimate at ZeRO-3 and ZeRO-2 (`estimate_zero3_model_states_mem_needs` in deepspeed/runtime/zero/stage3.py, the
ZeRO-2 one in stage_1_and_2.py), and below that the optimizers DeepSpeed picks for bf16 (model_states says which),
which keep whole-model gradients on every GPU. Their activations come on top: the inputs of every layer of a
micro-batch kept for backward (with --gradient_checkpointing, each layer's input and one layer's whole). A
vision-language policy's vision tower is counted apart: frozen (--freeze_vision_tower), bf16 weights without
gradients or Adam states; trained, with them and its layers' inputs over one image per row kept for backward,
the image as its processor cuts it (Idefics3's tiles, Qwen-VL's patches up to max_pixels). Frozen
roles (reference, reward models) hold bf16 weights partitioned over their ranks (in CPU memory with --ref_offload)
plus the gathered largest layer. A forward over the vocabulary adds its logits: bf16, their fp32 copy and the fp32
logsumexp work of one micro-batch; with --routing_replay the actor's micro-batch carries each token's experts too
(an int16 per MoE layer and expert: 128 bytes a token for Mixtral-8x7B). The GPUs are taken to compute in bf16
(Ampere and later), and the engines too unless --vllm_dtype float32 (twice the bytes for their weights and KV
cache). A vLLM engine takes
--vllm_gpu_memory_utilization of each of its GPUs, in which its shard of the weights, its own working memory and a
KV cache must fit. Colocated roles add up on their GPUs; with --colocate_all the engines count at their full share,
as they need it free when they start and wake.

    python ppo_ray.py ... --dry_run          # prints the plan, refuses one that does not fit, starts nothing
"""

import copy
import json
import os

import torch
from transformers import (CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForSequenceClassification)
from transformers import __version__ as transformers_version
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from common import routing_replay
from common.args import UserError, config_file
from common.partial_rollouts import pool_capacity
from common.ppo_tricks import uses_reference
from common.vlm import sequence_classification_class

GiB = 2**30
# What a vLLM engine keeps besides weights and KV cache: activations of a batch, CUDA graphs, NCCL buffers (rough).
VLLM_OVERHEAD_GIB = 4.0
# An engine whose KV cache holds fewer full-length sequences than this spends its time waiting, not generating.
MIN_KV_SEQUENCES = 8
# fp32 bytes per logit a vocabulary forward holds at once: bf16 logits (2) + their fp32 copy (4) + logsumexp (4).
LOGIT_BYTES = 10
# bf16 bytes a decoder layer keeps per token for its backward, per unit of hidden and of MLP width: the norms',
# attention's and the projections' inputs and outputs (flash-attention keeps no seq x seq scores), and SwiGLU's gate,
# up, activation and product. Korthikanti et al. 2022 ("Reducing Activation Recomputation") count 34 x hidden for a
# GPT layer with a 4 x hidden MLP; split over a Llama layer's two widths and rounded up.
ACTIVATION_BYTES_PER_HIDDEN, ACTIVATION_BYTES_PER_INTERMEDIATE = 18, 8


class PlanSkipped(Exception):
    """The plan cannot be made for these models; the message says why, and the run goes on unchecked."""


def read_config(path: str, flag: str):
    """A model's config through transformers' AutoConfig (its attribute maps name GPT-2's n_embd hidden_size), from
    its folder or the local hub cache: the pre-flight loads no weights and downloads nothing."""
    file = config_file(path)
    if file is None:
        raise UserError(f"{flag} {path} has no config.json here; the memory plan needs the model folder locally.")
    with open(file) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise PlanSkipped(f"{flag} {path} is a {model_type!r} model, which transformers {transformers_version} does "
                          f"not know (remote code is not run here), so its sizes are unknown")
    return AutoConfig.from_pretrained(os.path.dirname(file))


def model_sizes(config, scalar_head: bool = False) -> dict:
    """Sizes of the model transformers builds from `config`: as a causal LM, or with a one-label scalar head instead
    of the LM head (critic, reward model). The model is built on the meta device, so its parameters are counted as
    transformers makes them (every expert of a mixture of experts, biases, tied embeddings once) without memory."""
    text = config.get_text_config(decoder=True)  # a vision-language model's language model
    try:
        hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
    except AttributeError as e:
        raise PlanSkipped(f"its config names no {e.name}, a shape the plan needs") from None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    width = mlp_width(text)
    if width is None:
        raise PlanSkipped(f"its {type(text).__name__} names no MLP width the plan knows (intermediate_size, ffn_dim, "
                          f"n_inner), which the activations need")
    if scalar_head:
        config = copy.deepcopy(config)
        config.num_labels = 1
    vision_language = config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and hasattr(config, "vision_config")
    model_class = (AutoModelForSequenceClassification if scalar_head else
                   AutoModelForImageTextToText if vision_language else AutoModelForCausalLM)
    try:
        with torch.device("meta"):
            model = (sequence_classification_class(config)._from_config(config) if scalar_head and vision_language
                     else model_class.from_config(config))
    except ValueError as e:  # no such head for this model type
        raise PlanSkipped(f"transformers cannot build it as a {model_class.__name__} ({e})") from None
    params = sum(p.numel() for p in model.parameters())  # a tied matrix once
    # What a ZeRO-3 forward gathers whole at a time: one block of a layer stack, or a module's own weights (the
    # embedding, the LM head, a mixture of experts' fused expert tensors).
    blocks = [sum(p.numel() for p in block.parameters()) for stack in model.modules()
              if isinstance(stack, torch.nn.ModuleList) for block in stack]
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    # LoRA's A (r, in) and B (out, r) on every linear layer of the backbone (not the head): r x (in + out), at rank 1
    lora_per_rank = sum(sum(m.weight.shape) for m in model.base_model.modules()
                        if isinstance(m, (torch.nn.Linear, Conv1D)))
    layer_activations = ACTIVATION_BYTES_PER_HIDDEN * hidden + ACTIVATION_BYTES_PER_INTERMEDIATE * width  # per token
    # --routing_replay's experts of a token: an int16 per MoE layer and expert it goes to
    routes_per_token = 2 * sum(router.top_k for router in routing_replay.trainer_routers(model))
    return {"params": params, "largest_layer": max(blocks + own), "kv_per_token": 2 * layers * kv_heads * head_dim * 2,
            **(vision_sizes(model) if vision_language else {"vision_params": 0, "activations_per_patch": 0,
                                                             "activations_per_image": 0}),
            "routes_per_token": routes_per_token,
            "vocab": model.get_input_embeddings().weight.shape[0], "lora_per_rank": lora_per_rank,
            "quantized_4bit": quantized_4bit(model),
            "activations_per_token": {"all layers": layers * layer_activations,
                                      "checkpointed": layers * 2 * hidden + layer_activations}}


def vision_sizes(model) -> dict:
    """A vision-language model's vision tower: its parameters, and the bf16 bytes its layers keep for backward when
    it trains, per patch (every layer's inputs, with the decoder layer's bytes per unit of width) and per image of
    vision_config's image_size (sizes_of counts an image as its processor cuts it: patches_per_image). The image's
    tokens in the language model are part of the sequence, counted with its activations."""
    from common.vlm import vision_tower

    vision = model.config.vision_config
    tower = vision_tower(model)
    # Qwen2-VL's tower names its layers `depth` and its width `embed_dim` (its hidden_size is the merger's output)
    layers = getattr(vision, "num_hidden_layers", None) or vision.depth
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    intermediate = getattr(vision, "intermediate_size", None) or getattr(vision, "mlp_ratio", 4) * width
    per_patch = layers * (ACTIVATION_BYTES_PER_HIDDEN * width + ACTIVATION_BYTES_PER_INTERMEDIATE * intermediate)
    return {"vision_params": sum(p.numel() for p in tower.parameters()), "activations_per_patch": per_patch,
            "activations_per_image": per_patch * patches_per_image(None, vision)}


def patches_per_image(folder: str | None, vision) -> int:
    """The most patches the vision tower encodes for one image, from the processor settings saved beside the model
    (`folder`'s preprocessor_config.json), as the processor cuts images: Qwen-VL's dynamic resolution, up to
    max_pixels of patch_size x patch_size patches; Idefics3's and SmolVLM's tiles, up to ceil(size / max_image_size)
    tiles a side of image_size each, plus the whole image; else one image of vision_config's image_size."""
    per_tile = (getattr(vision, "image_size", 0) // getattr(vision, "patch_size", 1)) ** 2
    file = folder and os.path.join(folder, "preprocessor_config.json")
    if not file or not os.path.isfile(file):
        return per_tile
    with open(file) as f:
        settings = json.load(f)
    size, tile = settings.get("size") or {}, (settings.get("max_image_size") or {}).get("longest_edge")
    pixels = settings.get("max_pixels") or size.get("longest_edge")
    if ("max_pixels" in settings or "temporal_patch_size" in settings) and pixels:  # Qwen-VL: up to max_pixels
        return pixels // settings.get("patch_size", 14) ** 2
    if settings.get("do_image_splitting") and tile and size.get("longest_edge"):
        side = -(-size["longest_edge"] // tile)
        return (side ** 2 + 1) * per_tile
    return per_tile


def quantized_4bit(model) -> int:
    """Parameters bitsandbytes stores in 4 bits under --load_in_4bit: the weights of the modules transformers'
    replacement rule turns into Linear4bit (integrations/bitsandbytes.py, replace_with_bnb_linear: exactly nn.Linear
    or Conv1D, less get_keys_to_not_convert's LM head and tied or last modules). Everything else stays bf16: the
    embeddings, norms, biases, and transformers 5's fused mixture-of-experts tensors (Mixtral's `mlp.experts`, 45 of
    its 47 billion parameters), which are parameters of no nn.Linear."""
    keep = get_keys_to_not_convert(model)
    return sum(m.weight.numel() for name, m in model.named_modules()
               if (type(m) is torch.nn.Linear or isinstance(m, Conv1D)) and should_convert_module(name, keep))


def mlp_width(text) -> int | None:
    """The MLP width a token goes through in a decoder layer: with a mixture of experts, its top-k experts' and any
    shared expert's together (or a dense layer's, if wider); None when the config names none."""
    dense = next((getattr(text, k) for k in ("intermediate_size", "ffn_dim", "n_inner")
                  if isinstance(getattr(text, k, None), int)), None)
    if dense is None and hasattr(text, "n_inner"):  # GPT-2, GPT-J, CodeGen: n_inner None is 4 x hidden
        dense = 4 * text.hidden_size
    top_k = getattr(text, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or top_k < 1:
        return dense
    expert = getattr(text, "moe_intermediate_size", None) or dense  # Mixtral's experts are intermediate_size wide
    if expert is None:
        return None
    shared = (getattr(text, "shared_expert_intermediate_size", None)  # Qwen2-MoE
              or (getattr(text, "n_shared_experts", None) or 0) * expert)  # DeepSeek
    return max(dense or 0, top_k * expert + shared)


def trained(args, sizes: dict, gpus: int, tokens: int) -> dict:
    """GPU bytes of a trained role's rank, by part (and the CPU bytes of the role): its model states, and the
    activations of a micro-batch of `tokens`. `sizes` is the model's model_sizes.

    With --lora_rank only the adapters have model states (counted as on every linear layer, the most any
    --target_modules can give); the frozen weights are bf16, partitioned under ZeRO-3 with a layer gathered at a
    time, or whole with QLoRA, 4-bit where bitsandbytes quantizes (quantized_4bit) and bf16 elsewhere.
    """
    from common.deepspeed_utils import trained_zero_stage

    params = sizes["params"]
    # bf16=True: the stage the GPUs will run at, whatever machine makes the plan (--dry_run on a CPU login node)
    stage = trained_zero_stage(args.zero_stage, gpus, args.offload_optimizer, args.load_in_4bit, bf16=True)
    activations = tokens * sizes["activations_per_token"]["checkpointed" if args.gradient_checkpointing
                                                          else "all layers"]
    tower = {}
    if sizes["vision_params"] and getattr(args, "freeze_vision_tower", True):  # no gradients, no Adam states
        params -= sizes["vision_params"]
        tower = {"frozen vision tower": 2 * sizes["vision_params"] // (gpus if stage == 3 else 1)}
    elif sizes["vision_params"]:  # one image per micro-batch row; a trained tower keeps its layers' inputs
        activations += args.micro_train_batch_size * sizes["activations_per_image"]
    if args.lora_rank:
        if args.load_in_4bit:
            four_bit = sizes["quantized_4bit"]
            frozen_weights = {"frozen weights": four_bit // 2 + 2 * (params - four_bit)}
        elif stage == 3:
            frozen_weights = {"frozen weights": 2 * params // gpus, "gathered layer": 4 * sizes["largest_layer"]}
        else:
            frozen_weights = {"frozen weights": 2 * params}
        gpu, cpu = model_states(stage, args.lora_rank * sizes["lora_per_rank"], 0, gpus, args.offload_optimizer)
    else:
        frozen_weights = {}
        gpu, cpu = model_states(stage, params, sizes["largest_layer"], gpus, args.offload_optimizer)
    return {**frozen_weights, **tower, "model states": gpu, "activations": activations, "cpu": cpu}


def model_states(stage: int, params: int, largest: int, gpus: int, offload: bool) -> tuple[int, int]:
    """(GPU bytes per rank, CPU bytes in all) of bf16 weights, their gradients and fp32 Adam states at a ZeRO stage.

    Stages 3 and 2 are DeepSpeed's estimates. Below that DeepSpeed keeps gradients of the whole model on every GPU:
    at stage 1 in bf16 with fp32 accumulation (ds_config) it picks its BF16_Optimizer, whose fp32 gradient buffer
    is as large as the model (deepspeed/runtime/bf16_optimizer.py), or with an offloaded optimizer a per-parameter
    fp32 grad_accum (stage_1_and_2.py); only the fp32 master weights and Adam's two moments (12 bytes) are split.
    At stage 0 its bf16 wrapper (FP16_Optimizer for bf16, engine.py's DDP_BFLOAT16) keeps an fp32 master copy of
    every weight and its fp32 gradient besides the bf16 ones, and Adam's moments: 20 bytes, none of them split.
    """
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=gpus,
                                                            cpu_offload=offload, cpu_offload_params=False)
        # The estimate's 18 bytes a parameter are the gradients, fp32 weights and Adam's moments, not the bf16 weight
        # partition itself (its ZeRO-2 twin counts those 2 bytes apart); on an H100, SFT of a 0.9B model on one GPU
        # peaked at 1.15x the estimate without them, 1.05x with them (launch/gpu_trainers.py).
        return gpu + (0 if offload else 2 * params // gpus), cpu
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=offload)
        return gpu, cpu
    if stage == 1:
        split = 12 * params // gpus
        return (2 + 4) * params + (0 if offload else split), (12 * params if offload else 0)
    return 20 * params, 0


def frozen(params: int, largest: int, gpus: int, offload: bool) -> dict:
    """GPU bytes of a frozen ZeRO-3 role's rank: its bf16 weight partition, unless offloaded, and a gathered layer."""
    return {"weights": 0 if offload else 2 * params // gpus, "gathered layer": 4 * largest,
            "cpu": 2 * params if offload else 0}


def sizes_of(path: str, flag: str, scalar_head: bool = False) -> dict:
    """model_sizes of the model at `path`, a PlanSkipped naming it."""
    config = read_config(path, flag)
    try:
        sizes = model_sizes(config, scalar_head)
    except PlanSkipped as e:
        raise PlanSkipped(f"{flag} {path}: {e}") from None
    if sizes["vision_params"]:
        patches = patches_per_image(os.path.dirname(config_file(path)), config.vision_config)
        sizes["activations_per_image"] = sizes["activations_per_patch"] * patches
    return sizes


def plan(args) -> dict:
    """{GPU group (the GPUs a set of colocated roles shares): (GPU count, {role: bytes it puts on each, by part})}."""
    policy = sizes_of(args.pretrain, "--pretrain")
    rms = [sizes_of(p, "--reward_pretrain", scalar_head=True) for p in args.reward_pretrain or []]
    use_critic = args.advantage_estimator == "gae"
    critic_path = args.critic_pretrain or (args.reward_pretrain[0] if args.reward_pretrain else args.pretrain)
    critic = sizes_of(critic_path, "--critic_pretrain", scalar_head=True) if use_critic else None
    seq = args.prompt_max_len + args.generate_max_len
    rollout_micro = args.micro_rollout_batch_size or args.micro_train_batch_size

    def logits(micro: int) -> int:
        return micro * seq * policy["vocab"] * LOGIT_BYTES

    n_actor, engines_gpus = args.actor_num_workers, args.vllm_num_engines * args.vllm_tensor_parallel_size
    train_tokens = args.micro_train_batch_size * seq
    groups = {"actor": (n_actor, {"actor": {
        **trained(args, policy, n_actor, train_tokens),
        "logits": logits(max(args.micro_train_batch_size, rollout_micro)),
        "routes": max(args.micro_train_batch_size, rollout_micro) * seq * policy["routes_per_token"]
        if getattr(args, "routing_replay", False) else 0}})}

    def put(group: str, gpus: int, role: str, need: dict) -> None:
        groups.setdefault(group, (gpus, {}))[1][role] = need

    if uses_reference(args) and not args.lora_rank:  # with LoRA the actor's own frozen weights are the reference
        shared = args.colocate_actor_ref or args.colocate_all
        gpus = n_actor if shared else args.ref_num_workers
        put("actor" if shared else "reference", gpus, "reference",
            {**frozen(policy["params"], policy["largest_layer"], gpus, args.ref_offload),
             "logits": logits(rollout_micro)})
    if getattr(args, "teacher_pretrain", None):  # on-policy distillation's teacher, placed as the reference is
        teacher = sizes_of(args.teacher_pretrain, "--teacher_pretrain")
        shared = args.colocate_actor_ref or args.colocate_all
        gpus = n_actor if shared else args.ref_num_workers
        put("actor" if shared else "teacher", gpus, "teacher",
            {**frozen(teacher["params"], teacher["largest_layer"], gpus, args.ref_offload),
             "logits": logits(rollout_micro)})
    critic_group = "actor" if args.colocate_all else "critic"
    critic_gpus = n_actor if args.colocate_all else args.critic_num_workers
    if use_critic:
        put(critic_group, critic_gpus, "critic", trained(args, critic, critic_gpus, train_tokens))
    for i, rm in enumerate(rms):
        beside_critic = args.colocate_all or (args.colocate_critic_reward and use_critic)
        gpus = critic_gpus if beside_critic else args.reward_num_workers
        put(critic_group if beside_critic else f"reward model {i + 1}", gpus, f"reward model {i + 1}",
            frozen(rm["params"], rm["largest_layer"], gpus, args.ref_offload))
    scale = 2 if args.vllm_dtype == "float32" else 1  # the engines' weights and KV cache in fp32, not bf16
    weights = scale * 2 * policy["params"] // args.vllm_tensor_parallel_size
    budget = args.vllm_gpu_memory_utilization * args.gpu_memory_gib * GiB
    kv = budget - weights - VLLM_OVERHEAD_GIB * GiB
    put("actor" if args.colocate_all else "vLLM", engines_gpus, "vLLM",
        {"weights": weights, "overhead": VLLM_OVERHEAD_GIB * GiB, "KV cache": max(0, kv),  # KV heads split over TP:
         "sequences": kv * args.vllm_tensor_parallel_size / (scale * policy["kv_per_token"]) / seq})
    return groups


def gpu_bytes(need: dict) -> float:
    return sum(v for k, v in need.items() if k not in ("cpu", "sequences"))


def describe(args, groups: dict) -> str:
    """The plan as lines a person reads: each GPU group, each role's parts, the total against the GPU's memory."""
    lines = [f"memory plan per GPU ({args.gpu_memory_gib:g} GiB each), from the models' config.json:"]
    for group, (gpus, roles) in groups.items():
        total = sum(gpu_bytes(need) for need in roles.values())
        lines.append(f"  {group} GPUs x{gpus}: {total / GiB:.1f} GiB")
        for role, need in roles.items():
            parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in need.items() if k not in ("cpu", "sequences") and v)
            extra = (f"; KV cache holds {max(0, need['sequences']):.0f} sequences of full length"
                     if "sequences" in need else "")
            cpu = f"; {need['cpu'] / GiB:.0f} GiB of CPU memory over its nodes" if need.get("cpu") else ""
            lines.append(f"    {role}: {gpu_bytes(need) / GiB:.1f} GiB ({parts}){extra}{cpu}")
    return "\n".join(lines + outside_the_gpus(args, groups))


def outside_the_gpus(args, groups: dict) -> list[str]:
    """What the plan leaves out on purpose, said where it is printed: the driver's process, which holds no GPU,
    serves --agent_fn's endpoint (a thread per request; processes the agents start are the user's), and
    --partial_rollouts keeps max(1, --max_staleness) rollouts' samples under way, which the KV cache may not hold."""
    lines = []
    if args.agent_fn:
        lines.append("  driver (no GPU): --agent_fn's OpenAI-compatible endpoint, a thread per request holding the "
                     "episodes' token ids; processes the agents start are outside this plan")
    if args.partial_rollouts:
        vllm = next(need for _, roles in groups.values() for role, need in roles.items() if role == "vLLM")
        per_engine = pool_capacity(args) * args.n_samples_per_prompt / args.vllm_num_engines
        lines.append(f"  --partial_rollouts: up to {per_engine:.0f} samples under way per engine, against KV cache "
                     f"for {max(0, vllm['sequences']):.0f} of full length; vLLM queues those that do not fit")
    return lines


def check(args, groups: dict) -> None:
    """Refuse, in one sentence saying what to change, a plan whose GPUs overflow or whose engines have no KV room."""
    vllm = next(need for _, roles in groups.values() for role, need in roles.items() if role == "vLLM")
    if vllm["sequences"] < MIN_KV_SEQUENCES:
        raise UserError(f"each vLLM GPU holds {vllm['weights'] / GiB:.1f} GiB of weights in its "
                        f"{args.vllm_gpu_memory_utilization:g} x {args.gpu_memory_gib:g} GiB, leaving KV cache for "
                        f"{max(0, vllm['sequences']):.0f} sequences of {args.prompt_max_len + args.generate_max_len} "
                        f"tokens (at least {MIN_KV_SEQUENCES} needed); raise --vllm_tensor_parallel_size or "
                        f"--vllm_gpu_memory_utilization.")
    for group, (gpus, roles) in groups.items():
        total = sum(gpu_bytes(need) for need in roles.values())
        if total > args.gpu_memory_gib * GiB:
            biggest = max(roles, key=lambda role: gpu_bytes(roles[role]))
            checkpointing = "" if args.gradient_checkpointing else "turn on --gradient_checkpointing, "
            raise UserError(f"the {group} GPUs would hold {total / GiB:.1f} GiB each ({', '.join(roles)}) of "
                            f"{args.gpu_memory_gib:g} GiB, {biggest} the most; give {biggest} more workers, offload "
                            f"(--offload_optimizer, --ref_offload), {checkpointing}lower the micro-batch sizes or "
                            f"--vllm_gpu_memory_utilization, or colocate less.")


def dry_run(args) -> None:
    """--dry_run: print the plan and refuse one that does not fit, or say in one line why there is no plan."""
    try:
        groups = plan(args)
    except PlanSkipped as e:
        print(f"memory plan skipped: {e}.")
        return
    print(describe(args, groups))
    check(args, groups)
    print("the plan fits.")


def preflight(args) -> None:
    """The check before a real start on GPUs, when every model is a local folder (a hub name has no config here)."""
    paths = [args.pretrain, args.critic_pretrain, *(args.reward_pretrain or [])]
    if not all(os.path.isdir(os.path.expanduser(p)) for p in paths if p):
        return
    try:
        groups = plan(args)
    except PlanSkipped as e:
        print(f"memory plan skipped: {e}; the run starts unchecked.")
        return
    check(args, groups)
