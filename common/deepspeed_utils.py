"""DeepSpeed plumbing shared by the training scripts: process setup, ZeRO config, model loading, optimizer, schedule.

One code path for CPU and GPU: on CUDA the model trains in bf16 with NCCL (and flash attention when installed),
on CPU in fp32 with gloo. `python script.py` runs as a single rank; `deepspeed --num_gpus N script.py` runs N.
"""

import glob
import importlib.util
import math
import os
import sys
import time

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification,
                          AutoTokenizer)
from transformers.integrations import HfDeepSpeedConfig

from common.args import UserError, check_causal_lm, check_model_path
from common.cpu_memory import keep_freed_memory
from common.lora import dequantized
from common.modeling import keep_router_loss
from common.net import free_port, release_port
from common.vlm import (complete_forward_inputs, is_vision_language, load_processor, modality_token_ids,
                        sequence_classification_class)
from common.vlm_ranks import run_tower_in_every_forward

# Parameters smaller than this stay whole on every rank under ZeRO-3: norms and biases, whose gathering would
# cost more than it saves. Kept low so that even the tiny test model is really partitioned.
ZERO3_PERSISTENCE_THRESHOLD = 10_000


# A DeepSpeed op build takes a few minutes at most; a lock older than this was left by a build that was killed.
STALE_BUILD_LOCK_S = 900


def wait_for_op_builds(timeout_s: float = STALE_BUILD_LOCK_S) -> None:
    """Wait, saying so, while another process JIT-builds a DeepSpeed op; refuse a lock left by a killed build.

    torch builds an op under <TORCH_EXTENSIONS_DIR>/<op>/ holding the file `lock`, and any other process that wants
    the op waits for that file to go, without a word and without end: a run killed mid-build leaves it behind.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")
    said = set()
    for lock in glob.glob(os.path.join(root, "**", "lock"), recursive=True):
        while os.path.exists(lock):
            try:
                age = time.time() - os.path.getmtime(lock)
            except FileNotFoundError:  # the build finished meanwhile
                break
            if age > timeout_s:
                raise UserError(f"{lock} is {age / 60:.0f} minutes old: a DeepSpeed op build that was killed left it "
                                f"behind, and every run would wait on it forever; delete it (rm {lock}) and rerun.")
            if lock not in said:
                print(f"waiting for {lock}: another process is building that DeepSpeed op (for {age:.0f} s); if "
                      f"none is, a killed build left it behind: delete it.", file=sys.stderr, flush=True)
                said.add(lock)
            time.sleep(1)


def keep_freed_cpu_memory() -> bool:
    """On CPU, have glibc's malloc keep freed memory for the next allocation (common/cpu_memory.py); returns whether
    it took effect. Only on CPU: on GPUs activations live in device memory, whose caching allocator already keeps it.
    """
    return get_accelerator().device_name() == "cpu" and keep_freed_memory()


# What an MPI or SLURM launch (`deepspeed --launcher openmpi|mvapich|slurm`, mpirun, srun) sets in each process it
# starts in place of WORLD_SIZE and RANK: Open MPI's, MPICH's (PMI), MVAPICH's and SLURM's names.
MPI_SIZE_AND_RANK_VARS = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"),
                          ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"), ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"))


def mpi_launch() -> tuple[int, int]:
    """(processes, this one's rank) of an MPI or SLURM launch of several processes; (1, 0) for anything else."""
    for size_var, rank_var in MPI_SIZE_AND_RANK_VARS:
        size, rank = os.environ.get(size_var, ""), os.environ.get(rank_var, "")
        if size.isdigit() and int(size) > 1 and rank.isdigit():
            return int(size), int(rank)
    return 1, 0


def launcher_world() -> tuple[int, int]:
    """(this process's rank, the number of processes) as the launcher started them, before the distributed world forms
    (mpirun and srun set no RANK or WORLD_SIZE)."""
    return int(os.environ.get("RANK", mpi_launch()[1])), int(os.environ.get("WORLD_SIZE", mpi_launch()[0]))


def init_distributed() -> tuple[int, int, int]:
    """Join (or, under plain `python`, create) the default process group; return (rank, world_size, local_rank).
    On CPU, also keep_freed_cpu_memory: every trainer and model worker comes through here.

    Launched by `deepspeed`/torchrun, RANK and the rest are set. An MPI or SLURM launch sets none of them, and
    DeepSpeed finds the ranks through mpi4py; filling in a world of one there made every process train alone."""
    keep_freed_cpu_memory()
    if "RANK" not in os.environ:
        if mpi_launch()[0] > 1:
            if importlib.util.find_spec("mpi4py") is None:
                raise UserError(f"this process is one of {mpi_launch()[0]} started by an MPI or SLURM launcher, "
                                f"which sets no RANK: DeepSpeed finds the ranks through mpi4py. Install it (pip "
                                f"install mpi4py), or launch with `deepspeed` or torchrun instead.")
        else:  # plain `python script.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port("127.0.0.1")))
    wait_for_op_builds()  # the CPU backend's shared-memory op is built on first use
    release_port(int(os.environ.get("MASTER_PORT", 0)))  # reserved by this rank 0's RayWorker.address, if so
    # Under MPI this sets RANK, WORLD_SIZE and LOCAL_RANK; on CUDA it binds the group to device LOCAL_RANK.
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():  # a visible device's index, also under Ray (ray_workers.join_world); DeepSpeed's
        torch.cuda.set_device(local_rank)  # engine and zero.Init call set_device(LOCAL_RANK) themselves
    unlink_shared_workspace()
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank


def unlink_shared_workspace() -> None:
    """Take this rank's shared-memory workspace out of /dev/shm once every rank has mapped it.

    On CPU, with all ranks on one node, DeepSpeed's communication op (deepspeed/ops/csrc/cpu/comm/shm.cpp) creates
    a 70 MB POSIX shared-memory segment per rank, named after the user, MASTER_ADDR, MASTER_PORT and the rank, and
    never unlinks it: each run left 70 MB of RAM per rank in /dev/shm until the next reboot, and a later run on the
    same port would open a dead run's segment. A mapping outlives its name, so the op keeps working; the memory goes
    back when the last rank exits.
    """
    if get_accelerator().device_name() != "cpu" or os.environ.get("LOCAL_SIZE") != os.environ.get("WORLD_SIZE"):
        return  # the same on every rank, so every rank or none reaches the barrier
    torch.distributed.barrier()  # each rank's init opened every other rank's segment: all are mapped now
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{torch.distributed.get_rank()}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # a DeepSpeed that cleans up after itself, or names it otherwise
        pass


def device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def use_bf16() -> bool:
    """bf16 on GPUs that compute in it (Ampere and later); fp32 on CPU, where bf16 matmuls are slow and tiny models
    lose precision, and on older GPUs, which torch calls bf16-capable by emulation and flash-attention refuses."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def trained_zero_stage(asked: int | None, world_size: int, offload_optimizer: bool = False,
                       load_in_4bit: bool = False, offload_params: bool = False, bf16: bool | None = None) -> int:
    """The ZeRO stage of a trained model: `asked` if given, else 3, or on one rank 0, where ZeRO has nothing to
    partition and stage 3's hooks only cost time (a tenth of a GRPO update of a 21M model on CPU; an SFT step of a
    0.9B model on an H100 took 1.7x stage 1's, bench/bench_sft_gpu.py) - 1 in bf16, the lowest stage that
    accumulates gradients in fp32 (ds_config). Offloading the optimizer needs stage 3 (any stage above 0), offloading
    the weights stage 3; QLoRA's 4-bit weights cannot be partitioned, so it gets 2 (0 alone). `bf16` is whether the
    ranks compute in bf16, by default whether this machine would (use_bf16)."""
    if asked is not None:
        return asked
    if load_in_4bit:
        return 0 if world_size == 1 else 2
    if world_size == 1 and not offload_optimizer and not offload_params:
        return 1 if (use_bf16() if bf16 is None else bf16) else 0
    return 3


def gradient_accumulation_steps(train_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """train_batch_size = micro_batch_size * accumulation * world_size, or a UserError saying what to change."""
    if train_batch_size % (micro_batch_size * world_size):
        raise UserError(
            f"--train_batch_size {train_batch_size} must be a multiple of --micro_train_batch_size "
            f"{micro_batch_size} x {world_size} ranks = {micro_batch_size * world_size}."
        )
    return train_batch_size // (micro_batch_size * world_size)


def ds_config(stage: int, train_batch_size: int, micro_batch_size: int, world_size: int, grad_clip: float = 1.0,
              offload_optimizer: bool = False, offload_params: bool = False, train: bool = True) -> dict:
    """A DeepSpeed config for ZeRO stage 0-3. `train=False` gives the config of a frozen (reference) model.

    In bf16 a trained model's gradients accumulate over micro-batches in fp32 from stage 1 up; DeepSpeed's default
    is the model's dtype, whose 8-bit mantissa loses the small micro-batches' share of a sum. Stage 0 cannot
    (DeepSpeed raises NotImplementedError for it) and accumulates in bf16."""
    if stage not in (0, 1, 2, 3):
        raise UserError(f"--zero_stage must be 0, 1, 2 or 3, got {stage}.")
    if offload_optimizer and train and stage == 0:
        raise UserError("--offload_optimizer keeps the optimizer's state in CPU memory, which ZeRO does from stage 1 "
                        "up; give --zero_stage 1, 2 or 3, or leave --offload_optimizer out.")
    if offload_params and train and stage != 3:
        raise UserError("--offload_params keeps the weights in CPU memory between their uses, which only ZeRO-3 does "
                        "(it partitions them); give --zero_stage 3, or leave --offload_params out.")
    offload = lambda on: {"device": "cpu", "pin_memory": torch.cuda.is_available()} if on else {"device": "none"}
    zero = {
        "stage": stage,
        "offload_param": offload(offload_params and stage == 3),
        "offload_optimizer": offload(offload_optimizer and train and stage > 0),
        "stage3_param_persistence_threshold": ZERO3_PERSISTENCE_THRESHOLD,
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    }
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(train_batch_size, micro_batch_size, world_size),
        "train_batch_size": train_batch_size,
        "zero_optimization": zero,
        "bf16": {"enabled": use_bf16()},
        "gradient_clipping": grad_clip,
        "steps_per_print": 10**9,  # the scripts log for themselves
        "zero_allow_untested_optimizer": True,
        "wall_clock_breakdown": False,
    }
    if not train:
        del config["gradient_clipping"]
    elif use_bf16() and stage > 0:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def load_tokenizer(path: str, flag: str = "--pretrain"):
    check_model_path(path, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"{flag} {path}: no tokenizer could be loaded ({e}).") from None
    if tokenizer.eos_token is None:
        raise UserError(f"{flag} {path}: its tokenizer has no end-of-sequence token, which ends every response "
                        f"these scripts train on or generate; set eos_token in its tokenizer_config.json.")
    if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is always masked out
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, config: dict, model_class=AutoModelForCausalLM, gradient_checkpointing: bool = False,
               flag: str = "--pretrain", dropout: bool = False, torch_compile: bool = False, **kwargs):
    """Load a Hugging Face model; under ZeRO-3 it is partitioned while it loads, never whole on one rank.

    transformers partitions at load while a HfDeepSpeedConfig object is alive, so it is kept on the model. Dropout is
    off (disable_dropout) unless `dropout`: only SFT trains with the dropout a model's config asks for. A
    vision-language model asked for as a causal LM loads whole, vision tower included, and asked for as a sequence
    classifier with the scalar head of common/vlm.py (transformers has none for it); its backbone completes the
    inputs that its processor makes from the token ids (common/vlm.py complete_forward_inputs), and under ZeRO-3 on
    several ranks it runs its vision tower in every forward, images or not (common/vlm_ranks.py). `torch_compile`:
    compile_blocks.
    """
    check_model_path(path, flag)
    # a vision-language model's processor: the tokens of each modality, and a family it cannot serve refused first
    processor = load_processor(path, flag) if is_vision_language(path) else None
    if model_class is AutoModelForCausalLM and is_vision_language(path):
        model_class = AutoModelForImageTextToText
    elif model_class is AutoModelForSequenceClassification and is_vision_language(path):
        model_class = sequence_classification_class(path)
    if model_class is AutoModelForCausalLM:
        check_causal_lm(path, flag)
    hf_ds_config = HfDeepSpeedConfig(config) if config["zero_optimization"]["stage"] == 3 else None
    dtype = torch.bfloat16 if use_bf16() else torch.float32
    for attn in dict.fromkeys([attention_implementation(dtype), "sdpa", "eager"]):  # the fastest the model takes
        try:
            model = model_class.from_pretrained(path, dtype=dtype, attn_implementation=attn, **kwargs)
            break
        except OSError as e:
            raise UserError(f"{flag} {path}: no model could be loaded ({e}).") from None
        except ValueError as e:  # e.g. GPT-J: "does not support an attention implementation through sdpa yet"
            if "attention implementation" not in str(e) or attn == "eager":
                raise
    model._hf_ds_config = hf_ds_config
    if processor is not None:
        complete_forward_inputs(model, modality_token_ids(processor))
    several_ranks = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if processor is not None and hf_ds_config is not None and several_ranks:
        run_tower_in_every_forward(model, processor)  # each rank's forwards gather the tower, images or not
    if hf_ds_config is not None:
        gather_expert_blocks_whole(model)
    model.config.use_cache = False
    if not dropout:
        disable_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if torch_compile:
        compile_blocks(model, f"{flag} {path}")
    return model


def compile_blocks(model, source: str) -> list[str]:
    """Compile the forward of each of the model's repeated blocks with torch.compile (the classes transformers keeps
    whole across devices, `_no_split_modules`: its decoder layers, a vision tower's layers); returns the classes.

    Block by block, not the whole model: gradient checkpointing's recomputation and the scripts' own forward hooks
    stay outside the compiled code, and a padded batch's changing length costs one recompilation, after which the
    graphs take any length. Under ZeRO-3 each block becomes a leaf, gathered whole by one hook outside its compiled
    forward: DeepSpeed's hooks on the modules inside it would break its graph into dozens. The blocks of one class
    share a graph where their forward reads no per-layer setting (the KV cache's layer index is one: the trainers
    run without a cache); one that does (a hybrid's layer types) gets a graph per kind, so the recompilation limit
    is raised to the number of blocks, beyond which torch would run the rest uncompiled without an error.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise UserError(f"{source}: --torch_compile compiles a model's repeated blocks, which transformers names in "
                        f"_no_split_modules, and {type(model).__name__} names none; leave --torch_compile out.")
    classes = sorted({type(b) for b in blocks}, key=lambda c: c.__name__)
    if getattr(model, "_hf_ds_config", None) is not None:
        deepspeed.utils.set_z3_leaf_modules(model, classes)
    for block in blocks:
        block.forward = torch.compile(block.forward)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(blocks) + 8)
    return [c.__name__ for c in classes]


def gather_expert_blocks_whole(model) -> list[str]:
    """Make every mixture-of-experts block whose experts are modules of their own (an nn.ModuleList, each expert
    called only for the tokens routed to it) one ZeRO-3 leaf, gathered whole for its forward; returns the classes.

    ZeRO-3 gathers a module's parameters when the module is called, a collective across ranks: ranks that route
    their tokens to different experts would gather different experts and wait for each other forever (DeepSpeed
    #7461, OpenRLHF #1063). transformers 5 fuses its families' experts into one module, called for every batch,
    which needs nothing; remote-code and older layouts keep a list.
    """
    classes = {type(m) for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.ModuleList)}
    if classes:
        deepspeed.utils.set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__name__))
    return sorted(c.__name__ for c in classes)


def disable_dropout(model) -> None:
    """Turn every dropout of `model` off, in train mode too.

    The preference and RL objectives compare log-probs of one model across forwards: the policy's with the
    reference's (DPO, KTO), the update's with the experience pass's and vLLM's (PPO), a chosen score with a rejected
    one (RM). Dropout makes each side a different random subnetwork, so the ratios, KL terms and margins are noise
    from the first step: on a GPT-2 or OPT model (dropout 0.1 in their configs) vLLM's and the update's log-probs of
    the same tokens differed by 0.06 on average, where Llama-like models, whose dropout is 0, agree to 1e-7. Models
    keep dropout in nn.Dropout modules (GPT-2's resid_pdrop) or as a float attribute they hand to the attention
    kernel or a functional dropout (Llama's attention_dropout, OPT's dropout); both are set to 0, and so is
    LayerDrop (OPT's layerdrop skips whole layers at random in train mode). The config is left as it is, so that a
    saved model keeps the dropout its user gave it for later fine-tuning. LoRA adapters, added after, keep
    --lora_dropout.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if type(value) is float and ("dropout" in name.lower() or name.endswith(("pdrop", "layerdrop"))):
                setattr(module, name, 0.0)


def attention_implementation(dtype: torch.dtype) -> str:
    """flash-attention 2 on CUDA in bf16/fp16 when it is installed, else PyTorch's sdpa. flash-attn's kernels take
    only half precision and fail at the first forward of an fp32 model (GPUs without bf16, before Ampere), which
    transformers only warns about when it loads the model."""
    half = dtype in (torch.bfloat16, torch.float16)
    return "flash_attention_2" if half and torch.cuda.is_available() and _has_flash_attn() else "sdpa"


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def cosine_schedule(optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.1):
    """Linear warmup up to the peak LR at the warmup's last step (at step 0 without warmup), then cosine decay down
    to min_lr_ratio x peak at the last step, `total_steps` - 1: the peak is taken once, and the floor reached."""
    warmup = max(1, math.ceil(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0
    peak = max(warmup - 1, 0)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw(model, lr: float, weight_decay: float, betas=(0.9, 0.95), offload: bool = False):
    """AdamW without weight decay on biases and norms; DeepSpeed's CPU Adam when the optimizer lives on the CPU.

    Otherwise torch's AdamW with its fused kernel (one pass over each tensor, on CPU and CUDA alike; Hugging Face's
    Trainer picks it too), falling back to the default multi-tensor one on a device without it. On 2 CPU cores a step
    of a 21M-parameter model took 13 ms fused against 62 ms: a sixth of a small PPO update.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # The full shape: under ZeRO-3 a partitioned parameter's data is an empty 1-D tensor, its shape is ds_shape.
        ndim = len(getattr(p, "ds_shape", p.shape))
        if p.requires_grad:
            (no_decay if ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas)
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except RuntimeError:  # "`fused=True` requires all the params to be ... of supported devices"
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def init_train_engine(model, config: dict, lr: float, weight_decay: float, total_steps: int, warmup_ratio: float,
                      min_lr_ratio: float, offload_optimizer: bool = False):
    """Wrap a model with DeepSpeed for training: AdamW + cosine schedule. Returns the engine."""
    wait_for_op_builds()  # the optimizer's op (cpu_adam with --offload_optimizer) may be built on first use
    optimizer = adamw(model, lr, weight_decay, offload=offload_optimizer)
    # The schedule is built on the optimizer DeepSpeed wraps (ZeRO regroups parameters), hence the callable.
    schedule = lambda wrapped: cosine_schedule(wrapped, total_steps, warmup_ratio, min_lr_ratio)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        # With no ZeRO, DeepSpeed averages the gradients over the ranks at every optimizer step by flattening them
        # into one buffer, all-reducing it, scaling it and copying it back, on one rank too, where the average is
        # the gradient itself: four passes over the model's bytes (a GRPO update of a 21M model on CPU, 16 rows:
        # 0.62 -> 0.59 s). The flag is the one DeepSpeed clears itself when it has no process group to reduce over.
        # (In bf16 one rank gets stage 1 unless --zero_stage 0 asks otherwise: trained_zero_stage.)
        engine.enable_backward_allreduce = False
    # from_pretrained hands the model over in eval mode, and only an evaluation's engine.train() switched it: until
    # then SFT trained without its dropout and --gradient_checkpointing checkpointed nothing (transformers
    # checkpoints only in train mode), and a resumed run trained otherwise than an uninterrupted one.
    engine.train()
    keep_router_loss(engine)
    return engine


def init_eval_engine(model, config: dict):
    """Wrap a frozen model (reference, reward) with DeepSpeed for inference; ZeRO-3 keeps it partitioned."""
    model.eval()
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def check_reference_tokenizer(args, tokenizer) -> None:
    """dpo.py's and kto.py's reference (--ref_pretrain, else --pretrain) must read the policy's vocabulary."""
    ref_pretrain = args.ref_pretrain or args.pretrain
    if load_tokenizer(ref_pretrain, "--ref_pretrain").get_vocab() != tokenizer.get_vocab():
        raise UserError(f"--ref_pretrain {ref_pretrain} has a different tokenizer from --pretrain {args.pretrain}; "
                        f"the reference model must share the policy's vocabulary (leave --ref_pretrain unset to "
                        f"use the starting policy).")


def load_reference(args, world_size: int, rank: int):
    """dpo.py's and kto.py's frozen reference model as a DeepSpeed engine: --ref_pretrain, else --pretrain. None with
    --lora_rank and no --ref_pretrain: the reference is then the policy with its adapters off (lora.reference), not
    a second copy of its weights."""
    if args.lora_rank and not args.ref_pretrain:
        if rank == 0:
            print("LoRA: the reference is the policy with its adapters off, not a second copy of its weights",
                  flush=True)
        return None
    # A frozen model has no optimizer state or gradients to shard: ZeRO-3 if the policy uses it (or the reference
    # is offloaded, which only stage 3 does), else none.
    stage = 3 if args.zero_stage == 3 or args.ref_offload else 0
    config = ds_config(stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                       offload_params=args.ref_offload, train=False)
    return init_eval_engine(load_model(args.ref_pretrain or args.pretrain, config, flag="--ref_pretrain"), config)


def gathered_state_dict(model, rank: int) -> dict[str, torch.Tensor]:
    """The full state dict on rank 0 (empty elsewhere), gathering ZeRO-3 shards one module at a time."""
    state = {}
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        partitioned = [p for _, p in params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
            if rank == 0:
                for name, p in params:
                    # a QLoRA base weight is packed in 4 bits: saved in full precision
                    full = dequantized(p, model.dtype)
                    state[f"{module_name}.{name}" if module_name else name] = full.detach().cpu().clone()
    if rank == 0:
        for name, buf in model.named_buffers():
            if name in model.state_dict():
                state[name] = buf.detach().cpu().clone()
    return state
