"""LoRA and QLoRA for every trainer (with peft): train small low-rank adapters on a frozen model, save it merged.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") turns each targeted linear layer's
W x into W x + (alpha / r) B A x, with A (r, in) random and B (out, r) zero: training starts from the model exactly,
and only A and B (and the scalar head of a reward model or critic) get gradients and optimizer state. QLoRA
(Dettmers et al. 2023) also stores the frozen W in 4 bits (bitsandbytes, CUDA only).

What the scripts use:
  - `check_args(args)` refuses, in one sentence and before anything loads, the flag combinations that cannot work;
  - `load_kwargs(args)` and `wrap(model, args, task_type)` load the base model (4-bit with --load_in_4bit) and put
    the adapters on it (a vision-language model's on its language model alone); with --lora_rank 0 the model is
    returned as it is;
  - `reference(model)` switches the adapters off inside a `with` block: the frozen reference of DPO, KTO and PPO is
    the base model itself, not a second copy of the weights;
  - `merged_state_dict` folds W + (alpha / r) B A back under the base model's own names: the saved model loads with
    plain `from_pretrained` and in vLLM, and the adapter is saved on its own beside it (checkpoint.save_hf_model);
  - `iter_merged_params` yields the merged weights of the adapted layers, and the linear layers beside them, for
    the weight sync to vLLM: every other weight is frozen, so the engines already hold it, except that QLoRA's first
    sync also sends every 4-bit layer dequantized (the engines loaded them in full precision).
"""

import contextlib
import os

import torch

from common.args import UserError

PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's own parameter names
ADAPTER = "default"  # the name peft gives the one adapter these scripts train


def check_args(args, gpu: bool | None = None) -> None:
    """Refuse LoRA/QLoRA flags that cannot work, before any model loads. `gpu`: whether the models train on GPUs
    (default: whether this process sees one; a Ray driver asks its cluster)."""
    if args.lora_rank < 0:
        raise UserError(f"--lora_rank must be 0 (train every weight) or a positive rank, got {args.lora_rank}.")
    if args.lora_rank and args.lora_alpha <= 0:
        raise UserError(f"--lora_alpha must be positive (the adapters' scale is alpha / rank), got {args.lora_alpha}.")
    if args.lora_rank and not 0 <= args.lora_dropout < 1:
        raise UserError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}.")
    if not args.load_in_4bit:
        return
    if not args.lora_rank:
        raise UserError("--load_in_4bit (QLoRA) freezes the model in 4 bits and trains adapters on it: give "
                        "--lora_rank too (16 is a common choice).")
    if not (torch.cuda.is_available() if gpu is None else gpu):
        raise UserError("--load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); on this machine leave it out "
                        "and train LoRA adapters on the full-precision model.")
    if args.zero_stage == 3:
        raise UserError("--load_in_4bit cannot be combined with --zero_stage 3, which partitions the weights that "
                        "4-bit loading packs; use --zero_stage 2 (the frozen 4-bit model is small enough to keep "
                        "whole on each GPU).")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes") from None


def settings(args) -> dict:
    """The LoRA flags a resumed run must share with its checkpoint (they fix what the checkpoint's tensors are):
    --lora_rank 0 too, so that turning LoRA on or off for a resumed run is refused in one sentence."""
    if not args.lora_rank:
        return {"--lora_rank": 0}
    return {"--lora_rank": args.lora_rank, "--lora_alpha": args.lora_alpha, "--target_modules": args.target_modules}


def load_kwargs(args) -> dict:
    """Extra from_pretrained arguments: QLoRA's 4-bit NF4 storage with bf16 compute, on this rank's GPU."""
    if not getattr(args, "load_in_4bit", False):
        return {}
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    return {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}


def wrap(model, args, task_type: str = "CAUSAL_LM"):
    """`model` with LoRA adapters on --target_modules (trainable) and everything else frozen; `model` itself when
    --lora_rank is 0. task_type "SEQ_CLS" (reward models, critics) also trains the scalar head whole."""
    if not args.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    targets = args.target_modules if args.target_modules == "all-linear" else [
        name.strip() for name in args.target_modules.split(",") if name.strip()]
    from common.vlm import outside_language_model

    outside = outside_language_model(model)  # a vision-language model's tower and connector: no adapters there
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets, task_type=task_type,
                        exclude_modules=(["score", "classifier"] if task_type == "SEQ_CLS" else []) + outside or None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    head_name = next((name for name, m in model.named_modules() if m is head), None) if tied else None
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name not in outside})
        where = " (LoRA adapts a vision-language model's language model alone)" if outside else ""
        raise UserError(f"--target_modules {args.target_modules}: {str(e).splitlines()[0]} Give 'all-linear' or "
                        f"some of this model's linear layers{where}: {','.join(linear)}.") from None
    from peft.tuners.lora import LoraLayer

    other = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, LoraLayer) and ADAPTER not in m.lora_A})
    if other:  # an embedding's adapter lives in lora_embedding_A/B, which merging and the weight sync do not read
        raise UserError(f"--target_modules {args.target_modules}: {','.join(other)} is not a linear layer, and LoRA "
                        f"here adapts linear layers only; leave it out.")
    if head_name and isinstance(model.get_base_model().get_submodule(head_name), LoraLayer):
        # merged, the head would differ from the embedding its config still ties it to: vLLM keeps one of the two
        raise UserError(f"--target_modules {args.target_modules}: {head_name} shares its weight with the input "
                        f"embedding (tie_word_embeddings), and an adapter on it would make the two differ, which "
                        f"the saved model and vLLM cannot hold; leave {head_name.rsplit('.', 1)[-1]} out.")
    numel = lambda p: getattr(p, "ds_numel", p.numel())  # a ZeRO-3 partitioned parameter's full size
    trained = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"LoRA: training {trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)", flush=True)
    return model


def is_lora(model) -> bool:
    return hasattr(getattr(model, "module", model), "peft_config")


def base_model(model):
    """The Hugging Face model under a DeepSpeed engine and a peft wrapper (the adapters stay in its layers)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "peft_config") else model


@contextlib.contextmanager
def unquantized(model):
    """A context in which save_pretrained takes `model` (a QLoRA run's base model) for the full-precision model its
    merged state dict describes. With a quantizer attached, transformers saves the model's own state dict (packed
    4-bit weights and the adapters) instead of the one it is given, and a quantization_config with it."""
    quantizer = model.__dict__.pop("hf_quantizer", None)
    config = model.config.__dict__.pop("quantization_config", None)
    try:
        yield model
    finally:
        if quantizer is not None:
            model.hf_quantizer = quantizer
        if config is not None:
            model.config.quantization_config = config


def reference(model):
    """A context in which `model` computes as its base model, adapters off: LoRA's free reference model."""
    model = getattr(model, "module", model)
    return model.disable_adapter() if hasattr(model, "peft_config") else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------- merging
def dequantized(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's value in `dtype` (the model's): a QLoRA base weight is stored packed in 4 bits with its
    quant_state, every other parameter is returned as it is."""
    if getattr(param, "quant_state", None) is None:
        return param
    import bitsandbytes.functional as bnb

    return bnb.dequantize_4bit(param.data, param.quant_state).to(dtype)


def merged_weight(weight, lora_a, lora_b, scale: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + scale * B A, computed in fp32 and returned in W's dtype; (out, in) like W, or transposed for layers that
    store it (in, out), as GPT-2's Conv1D does."""
    delta = scale * (lora_b.float() @ lora_a.float())  # (out, in)
    return (weight.float() + (delta.T if fan_in_fan_out else delta)).to(weight.dtype)


def _lora_layers(model) -> dict:
    """{peft module name: module} for every layer that carries this run's adapter."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def _expert_adapters(layers: dict) -> dict:
    """{peft name of the adapted parameter: (the name it has in the base model, its wrapper)} for LoRA on a
    mixture of experts' fused (experts, ., .) weights, which peft adapts as parameters (`ParamWrapper`,
    target_parameters; all-linear picks them under transformers 5): each wraps the module below it, so Mixtral's
    `mlp.experts` adapts down_proj, its `mlp.experts.base_layer` gate_up_proj, of `mlp.experts.base_layer.base_layer`.
    """
    adapters = {}
    for name, module in layers.items():
        if getattr(module, "num_experts", 1) > 1 and hasattr(module, "parameter_name"):
            base, inner = name, module
            while hasattr(inner, "base_layer"):
                base, inner = f"{base}.base_layer", inner.base_layer
            plain = f"{name.removeprefix(PEFT_PREFIX).replace('.base_layer', '')}.{module.parameter_name}"
            adapters[f"{base}.{module.parameter_name}"] = (name, plain, module)
    return adapters


def expert_delta(module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """(alpha / r) B A for each expert of a fused experts weight, in fp32 and in the weight's own (experts, ., .)
    layout: peft's ParamWrapper.get_delta_weight, from given (gathered) factors. A (experts x r, in) and
    B (out, r x experts) hold each expert's factors side by side."""
    experts = module.num_experts
    a = lora_a.float().reshape(experts, -1, lora_a.shape[-1])  # (experts, r, in)
    b = lora_b.float().reshape(lora_b.shape[0], -1, experts)  # (out, r, experts)
    layout = "o r e, e r i -> e o i" if module._did_swap_in_out_features else "o r e, e r i -> e i o"
    return module.scaling[ADAPTER] * torch.einsum(layout, b, a)


def merged_state_dict(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A full peft state dict (gathered, plain tensors) as the base model's state dict with the adapters merged in.

    Each adapted layer's `<layer>.base_layer.weight` becomes `<layer>.weight` = W + (alpha / r) B A, its bias keeps
    its name without `base_layer`, the adapter matrices go, and a trained copy of a head (peft's modules_to_save)
    replaces the original.
    """
    model = getattr(model, "module", model)
    layers = _lora_layers(model)
    experts = _expert_adapters(layers)
    merged = {}
    for key, tensor in state.items():
        name = key.removeprefix(PEFT_PREFIX)
        layer, _, param = name.rpartition(".")
        if ".lora_" in name or ".original_module." in name:
            continue  # folded into the base weight, or superseded by the trained copy
        if key in experts:
            wrapper, plain, module = experts[key]
            a, b = state[f"{wrapper}.lora_A.{ADAPTER}.weight"], state[f"{wrapper}.lora_B.{ADAPTER}.weight"]
            merged[plain] = (tensor.float() + expert_delta(module, a, b)).to(tensor.dtype)
            continue
        if layer.endswith(".base_layer"):
            layer = layer.removesuffix(".base_layer")
            module = layers.get(PEFT_PREFIX + layer)
            if param == "weight" and module is not None:
                a = state[f"{PEFT_PREFIX}{layer}.lora_A.{ADAPTER}.weight"]
                b = state[f"{PEFT_PREFIX}{layer}.lora_B.{ADAPTER}.weight"]
                tensor = merged_weight(tensor, a, b, module.scaling[ADAPTER], module.fan_in_fan_out)
        layer = layer.replace(f".modules_to_save.{ADAPTER}", "")
        merged[f"{layer}.{param}" if layer else param] = tensor
    return merged


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's own tensors (the LoRA matrices and trained heads) out of a full peft state dict."""
    return {k: v for k, v in state.items() if ".lora_" in k or f".modules_to_save.{ADAPTER}." in k}


def iter_merged_params(model, everything_quantized: bool = False):
    """Yield (Hugging Face name, weight) for each adapted layer, merged, and for the other linear layers beside one
    (children of the same module), as they are; with `everything_quantized`, also every other 4-bit layer,
    dequantized. Gathers ZeRO-3 shards one layer at a time.

    A collective under ZeRO-3, like weight_sync.iter_gathered_params: every trainer rank runs through it. Only the
    adapted layers change during LoRA training, but vLLM fuses sibling layers into one weight (q, k and v into
    qkv_proj; gate and up into gate_up_proj) and rebuilds a fused weight from the parts a sync sends: with
    --target_modules q_proj,v_proj alone, k's rows came back as uninitialised memory. Sending every linear sibling
    of an adapted layer fills each fused weight whole; with all-linear they are all adapted anyway.

    QLoRA (Dettmers et al. 2023) computes with the NF4 rounding of the weights, while the engines loaded them in full
    precision: the first sync of a 4-bit model passes `everything_quantized`, or layers no adapter touches (the MLPs
    under q_proj,v_proj) would be sampled from unquantized for the whole run.
    """
    import deepspeed

    model = getattr(model, "module", model)
    adapted = _lora_layers(model)
    experts = _expert_adapters(adapted)
    for wrapper, plain, module in experts.values():
        params = [module.get_param(), module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight]
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
            yield plain, (params[0].float() + expert_delta(module, params[1], params[2])).to(params[0].dtype)
    adapted = {name: m for name, m in adapted.items() if name not in {w for w, _, _ in experts.values()}}
    parents = {name.rpartition(".")[0] for name in adapted}
    is_2d = lambda p: len(getattr(p, "ds_shape", p.shape)) == 2  # a ZeRO-3 partitioned parameter's full shape
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name in adapted:
            params = [module.base_layer.weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight]
        elif name.endswith(".base_layer") or not isinstance(weight, torch.nn.Parameter) or \
                isinstance(module, torch.nn.Embedding):
            continue  # an adapted layer's base is sent merged, under the adapted layer's name
        elif (name.rpartition(".")[0] in parents and is_2d(weight)) or \
                (everything_quantized and getattr(weight, "quant_state", None) is not None):
            params = [weight]
        else:
            continue
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
            tensor = dequantized(params[0], model.dtype).detach()
            if name in adapted:
                tensor = merged_weight(tensor, params[1].detach(), params[2].detach(), module.scaling[ADAPTER],
                                       module.fan_in_fan_out)
            elif partitioned:
                tensor = tensor.clone()  # the gathered tensor is freed when the context ends
        yield name.removeprefix(PEFT_PREFIX) + ".weight", tensor
