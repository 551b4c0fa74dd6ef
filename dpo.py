"""Direct preference optimization (DPO), its variants (IPO, cDPO, hinge, robust) and the reference-free SimPO and ORPO.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model") fits a
policy to preference pairs with no reward model and no sampling: the reward is implicit,
r(x, y) = beta * log(pi(y|x) / pi_ref(y|x)), and the loss is the Bradley-Terry loss -log sigmoid(r(x, y_w) - r(x, y_l)).

    deepspeed --num_gpus 2 dpo.py --pretrain SFT_MODEL --dataset pairs.jsonl --apply_chat_template --beta 0.1
    python dpo.py ...                                   # one process, same flags

Implementation details, where they happen below:
  - the reference model is the starting policy, frozen and partitioned with ZeRO-3 like the policy (`--ref_offload`
    keeps its parameters in CPU memory); its tokenizer must be the policy's. With `--lora_rank` (common/lora.py) the
    policy trains adapters on its frozen weights, and the reference is those weights with the adapters switched off:
    no second copy;
  - a response's log-prob is summed over its tokens only; prompt and padding are masked out (common/data.py);
  - chosen and rejected responses go through each model in one forward pass, as one (2 x pairs, seq) batch;
  - `--packing_samples` concatenates that batch into one row with no padding; position_ids restart at each sequence
    so that each one attends only to itself, and each sequence's log-prob is summed over its own span of the row
    (common/modeling.py: sequence_sums): the log-probs and the loss are identical to the padded ones;
  - `--loss_type` picks the loss of a pair's margin (each function below names its paper): `sigmoid` is DPO's;
    `ipo` regresses the margin onto 1 / (2 beta) instead of pushing it to infinity (`--ipo` says the same);
    `hinge` is SLiC's; `robust` corrects DPO for labels flipped at the rate `--label_smoothing`; `simpo` and `orpo`
    compare the policy's own length-normalised log-probs and load no reference model at all;
  - `--label_smoothing eps` is conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"): each label
    is assumed wrong with probability eps;
  - `--nll_loss_coef` adds the token-mean NLL of the chosen responses (Pang et al. 2024, "Iterative Reasoning
    Preference Optimization"), which keeps their likelihood from falling along with the rejected ones';
  - a pair whose chosen and rejected texts are identical carries no preference: it is skipped, with a warning;
  - metrics are TRL's: rewards/{chosen,rejected,accuracies,margins}, logps/{chosen,rejected};
    perf/ref_forward_share is the fraction of a step spent in the reference model's forward pass.
"""

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

from common import checkpoint, data, lora, vlm
from common.args import (UserError, check_causal_lm, check_lengths, check_model_path, check_output_dir, check_packing,
                         parse_args, run_main)
from common.deepspeed_utils import (check_reference_tokenizer, device, ds_config, gradient_accumulation_steps,
                                    init_distributed, init_train_engine, launcher_world, load_model, load_reference,
                                    load_tokenizer, trained_zero_stage)
from common.logging_utils import MetricsLogger, print_rank0, progress
from common.modeling import next_token_logprobs, response_start, router_loss, sequence_sums
from common.output_lock import hold_output_folders


@dataclass
class Args:
    # --- model and data
    pretrain: str = ""
    """the model to start from, usually an SFT model: a Hugging Face model folder or hub name"""
    dataset: str = ""
    """training pairs: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    dataset_split: str = "train"
    """split to read when --dataset is a `datasets` name, a saved DatasetDict or a folder of per-split files"""
    eval_dataset: str | None = None
    """held-out pairs in the same format, for the eval loss and reward accuracy"""
    eval_dataset_split: str = "test"
    """split to read when --eval_dataset is a `datasets` name, a saved dataset or a folder of per-split files"""
    input_key: str = "prompt"
    """key of the prompt (text, or a list of chat messages)"""
    chosen_key: str = "chosen"
    """key of the preferred response"""
    rejected_key: str = "rejected"
    """key of the dispreferred response"""
    apply_chat_template: bool = False
    """render prompts with the tokenizer's chat template"""
    input_template: str | None = None
    """a template such as 'Question: {} Answer: ' the prompt is formatted into (without a chat template)"""
    max_len: int = 512
    """each prompt + response is truncated to this many tokens"""
    output_dir: str = "out/dpo"
    """where the final Hugging Face model, metrics and checkpoints go"""
    # --- training
    seed: int = 42
    """random seed"""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage: 0 (data parallel), 1, 2 or 3 (parameters partitioned); default 3, or on one rank 1 in
    bf16 and 0 in fp32, since stage 3 partitions nothing there and slows a step"""
    offload_optimizer: bool = False
    """keep the optimizer state in CPU memory (DeepSpeed CPU Adam)"""
    offload_params: bool = False
    """keep ZeRO-3 parameters in CPU memory"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    torch_compile: bool = False
    """compile each repeated block (decoder layer) with torch.compile: a first step that compiles, faster ones after"""
    train_batch_size: int = 32
    """pairs per optimizer step, across all ranks"""
    micro_train_batch_size: int = 8
    """pairs per forward pass on one rank; the rest is gradient accumulation"""
    max_epochs: int = 1
    """passes over the training data"""
    max_steps: int = 0
    """stop after this many optimizer steps (0: run --max_epochs)"""
    learning_rate: float = 5e-7
    """peak learning rate"""
    min_lr_ratio: float = 0.1
    """the cosine schedule ends at this fraction of the peak learning rate"""
    warmup_ratio: float = 0.03
    """fraction of the steps spent warming the learning rate up linearly"""
    weight_decay: float = 0.0
    """AdamW weight decay (never applied to biases and norms)"""
    grad_clip: float = 1.0
    """clip the gradient norm to this value"""
    # --- LoRA (peft)
    lora_rank: int = 0
    """train LoRA adapters of this rank on the frozen model instead of every weight (0: train every weight)"""
    lora_alpha: int = 16
    """LoRA's scale: the adapters' update is multiplied by lora_alpha / lora_rank"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input"""
    target_modules: str = "all-linear"
    """layers that get adapters: all-linear (every linear layer but the output head) or names, e.g. q_proj,v_proj"""
    load_in_4bit: bool = False
    """QLoRA: keep the frozen model in 4 bits (NF4 with bitsandbytes; CUDA only, with --lora_rank)"""
    # --- logging and checkpoints
    logging_steps: int = 1
    """log training metrics every this many steps"""
    eval_steps: int = 0
    """evaluate every this many steps (0: only at the end)"""
    save_steps: int = 0
    """save a resumable checkpoint every this many steps (0: never)"""
    ckpt_dir: str | None = None
    """where resumable checkpoints go (default: <output_dir>/checkpoints); a run resumes from the latest one"""
    keep_last_checkpoints: int = 2
    """how many resumable checkpoints to keep"""
    use_wandb: bool = False
    """also log to Weights & Biases (offline without WANDB_API_KEY)"""
    wandb_project: str = "rlhf-dpo"
    """wandb project name"""
    # --- DPO
    ref_pretrain: str | None = None
    """the frozen reference model (default: --pretrain, which with --lora_rank is the policy with its adapters off)"""
    ref_offload: bool = False
    """keep the reference model's ZeRO-3 parameters in CPU memory"""
    beta: float = 0.1
    """scale of the implicit reward beta * log(pi / pi_ref): the strength of the pull towards the reference"""
    label_smoothing: float = 0.0
    """conservative DPO: the assumed probability that a pair's preference is the wrong way round (0: plain DPO)"""
    loss_type: str = "sigmoid"
    """the loss of a pair: sigmoid (DPO), ipo, hinge (SLiC), robust (rDPO), simpo or orpo (both reference-free)"""
    ipo: bool = False
    """the IPO loss: the same as --loss_type ipo (OpenRLHF's flag)"""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (with --loss_type simpo; the paper's beta is 2 to 2.5)"""
    nll_loss_coef: float = 0.0
    """weight of an NLL loss on the chosen responses (0: none; ORPO's own is 1)"""
    packing_samples: bool = False
    """pack each micro-batch into one row without padding"""
    freeze_vision_tower: bool = True
    """a vision-language model's vision tower keeps its weights (its connector and language model train); false
    trains it too"""


# A resumed run must match its checkpoint in these flags (what makes it this run: model, data, schedule), besides
# the batch size, seed, number of ranks, ZeRO stage and LoRA settings (checkpoint.trainer_settings).
RUN_FLAGS = ("pretrain", "ref_pretrain", "dataset", "beta", "learning_rate", "warmup_ratio", "min_lr_ratio",
             "input_key", "chosen_key", "rejected_key", "apply_chat_template", "input_template", "max_len",
             "label_smoothing", "loss_type", "simpo_gamma", "nll_loss_coef")


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # no reference model is loaded for these


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid"):
    """The loss of each pair's log-ratio margin h, and the implicit rewards of its chosen and rejected responses.

    Every argument is (pairs,): response log-probs summed over tokens. Returns (losses, chosen_rewards,
    rejected_rewards), each (pairs,); the rewards beta * log(pi / pi_ref) carry no gradient.
      sigmoid: -log sigmoid(beta h) (Rafailov et al. 2023, eq. 7); with label_smoothing eps, cDPO's expectation
               over a label flipped with probability eps (Mitchell 2023)
      ipo:     (h - 1 / (2 beta))^2 (Azar et al. 2023, eq. 17)
      hinge:   max(0, 1 - beta h) (SLiC-HF, Zhao et al. 2023, eq. 1, with beta as its 1 / delta)
      robust:  ((1 - eps) (-log sigmoid(beta h)) - eps (-log sigmoid(-beta h))) / (1 - 2 eps), the unbiased loss
               under labels flipped at rate eps (rDPO, Chowdhury et al. 2024, eq. 8)
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    margins = chosen_logratios - rejected_logratios  # h in the IPO paper
    eps = label_smoothing
    if loss_type == "ipo":
        losses = (margins - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margins)
    elif loss_type == "robust":
        losses = ((1 - eps) * -F.logsigmoid(beta * margins) + eps * F.logsigmoid(-beta * margins)) / (1 - 2 * eps)
    else:
        losses = -(1 - eps) * F.logsigmoid(beta * margins) - eps * F.logsigmoid(-beta * margins)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def simpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0):
    """SimPO (Meng et al. 2024, eq. 6), reference-free: the reward is the length-normalised log-prob
    beta / |y| log pi(y|x), and -log sigmoid(r_w - r_l - gamma) asks the chosen reward to lead by the margin gamma.
    Arguments are (pairs,) per-token mean log-probs; returns (losses, chosen_rewards, rejected_rewards)."""
    chosen_rewards, rejected_rewards = beta * chosen_avg_logps, beta * rejected_avg_logps
    margins = chosen_rewards - rejected_rewards - gamma
    losses = -(1 - label_smoothing) * F.logsigmoid(margins) - label_smoothing * F.logsigmoid(-margins)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def orpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float):
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4-7), reference-free: -beta log sigmoid(log odds(y_w) -
    log odds(y_l)), where odds(y) = P / (1 - P) of the per-token mean likelihood P = exp(mean log pi(y|x)) and beta is
    the paper's lambda. ORPO's other term, the chosen responses' NLL, is added where --nll_loss_coef's is (at 1).
    Arguments are (pairs,) per-token mean log-probs; returns (losses, chosen_rewards, rejected_rewards)."""
    chosen, rejected = chosen_avg_logps.clamp(max=-1e-6), rejected_avg_logps.clamp(max=-1e-6)  # P < 1
    log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
    return -beta * F.logsigmoid(log_odds), beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach()


def preference_losses(args, chosen_logps, rejected_logps, ref_logps, lengths):
    """`args.loss_type`'s (losses, chosen_rewards, rejected_rewards) of a micro-batch's pairs, from their summed
    log-probs (pairs,), the reference's (None for the reference-free losses) and the responses' token counts."""
    if args.loss_type == "simpo":
        return simpo_loss(chosen_logps / lengths[0], rejected_logps / lengths[1], args.beta, args.simpo_gamma,
                          args.label_smoothing)
    if args.loss_type == "orpo":
        return orpo_loss(chosen_logps / lengths[0], rejected_logps / lengths[1], args.beta)
    return dpo_loss(chosen_logps, rejected_logps, *ref_logps, args.beta, args.label_smoothing, args.loss_type)


def nll_term(args, chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen responses' NLL per token, chosen_logps (pairs,) summed over `chosen_tokens` tokens, weighed by
    --nll_loss_coef, or by 1 under ORPO, whose objective L_SFT + lambda L_OR holds it (Hong et al. 2024)."""
    coef = 1.0 if args.loss_type == "orpo" else args.nll_loss_coef
    return coef * -chosen_logps.sum() / chosen_tokens.clamp(min=1)


def response_lengths(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of each chosen and of each rejected response: (pairs,) each, at least 1."""
    tokens = sequence_sums(batch["loss_mask"][:, 1:].float(), batch.get("position_ids"))  # (2 * pairs,)
    return tokens.clamp(min=1).chunk(2)


def forward_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the chosen and of the rejected responses, summed over response tokens: (pairs,) each."""
    images = {k: v for k, v in batch.items() if k.startswith("pixel_")}  # a vision-language model's images
    logprobs = next_token_logprobs(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"),
                                   response_start(batch["loss_mask"][:, 1:]),
                                   **images)  # (2 * pairs, seq - 1), or (1, total - 1)
    logps = sequence_sums(logprobs * batch["loss_mask"][:, 1:], batch.get("position_ids"))  # (2 * pairs,)
    return logps.chunk(2)


def ref_forward_logps(engine, ref_engine, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_logps of the frozen reference: its own engine, or without one (LoRA) the policy's adapters off."""
    with torch.no_grad(), lora.reference(engine) if ref_engine is None else contextlib.nullcontext():
        return forward_logps(ref_engine or engine, batch)
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


def check_loss_type(args) -> None:
    """Refuse a loss type and flags that do not go together, in one sentence; --ipo becomes --loss_type ipo."""
    if args.ipo:
        if args.loss_type not in ("sigmoid", "ipo"):
            raise UserError(f"--ipo asks for the IPO loss but --loss_type is {args.loss_type}; give one of the two.")
        args.loss_type = "ipo"
    if args.loss_type not in LOSS_TYPES:
        raise UserError(f"--loss_type {args.loss_type} is not one of {', '.join(LOSS_TYPES)}.")
    if args.label_smoothing and args.loss_type not in ("sigmoid", "robust", "simpo"):
        raise UserError(f"--label_smoothing is for the sigmoid, robust and simpo losses; leave it at 0 with "
                        f"--loss_type {args.loss_type}.")
    if args.loss_type == "robust" and not args.label_smoothing:
        raise UserError("--loss_type robust corrects for labels flipped at the rate --label_smoothing; give that "
                        "rate, in (0, 0.5).")
    if args.loss_type in REFERENCE_FREE and (args.ref_pretrain or args.ref_offload):
        raise UserError(f"--loss_type {args.loss_type} uses no reference model; leave out --ref_pretrain and "
                        f"--ref_offload.")
    if args.loss_type == "orpo" and args.nll_loss_coef:
        raise UserError("ORPO's loss holds the chosen responses' NLL at weight 1 already; leave out --nll_loss_coef.")


def collate(samples, tokenizer, packing: bool, dev, processor=None) -> dict:
    """Chosen responses then rejected ones, padded into one (2 * pairs, seq) batch or packed into one (1, total) row:
    one forward pass scores both."""
    sequences = [s["chosen"] for s in samples] + [s["rejected"] for s in samples]
    batch = data.pack_collate(sequences) if packing else data.pad_collate(sequences, tokenizer.pad_token_id)
    if processor is not None:
        batch.update(vlm.image_inputs(processor, sequences, packing))
    return {k: v.to(dev) for k, v in batch.items()}


@torch.no_grad()
def evaluate(engine, ref_engine, samples, args, tokenizer, rank, world_size, processor=None) -> dict:
    """Mean loss, reward accuracy and reward margin over the eval pairs, each rank taking every world_size-th pair."""
    engine.eval()
    names = ("loss", "correct", "margins", "pairs")  # sums over pairs
    stats = torch.zeros(len(names), device=device())
    mine = samples[rank::world_size]
    for i in range(0, math.ceil(len(samples) / world_size), args.micro_train_batch_size):
        chunk = mine[i: i + args.micro_train_batch_size] or samples[:1]  # every rank runs the same number of steps
        weight = 1.0 if mine[i: i + args.micro_train_batch_size] else 0.0
        batch = collate(chunk, tokenizer, args.packing_samples, device(), processor)
        ref_logps = None if args.loss_type in REFERENCE_FREE else ref_forward_logps(engine, ref_engine, batch)
        losses, chosen_rewards, rejected_rewards = preference_losses(args, *forward_logps(engine, batch), ref_logps,
                                                                     response_lengths(batch))
        stats += weight * torch.tensor([losses.sum().item(), (chosen_rewards > rejected_rewards).sum().item(),
                                        (chosen_rewards - rejected_rewards).sum().item(), len(chunk)], device=device())
    dist.all_reduce(stats)
    engine.train()
    total = dict(zip(names, stats.tolist()))
    return {"eval/loss": total["loss"] / total["pairs"], "eval/rewards/accuracies": total["correct"] / total["pairs"],
            "eval/rewards/margins": total["margins"] / total["pairs"]}


def check_args(args: Args) -> None:
    """Refuse flag and model mistakes before anything loads."""
    check_model_path(args.pretrain)
    if not vlm.check_trainer_args(args):
        check_causal_lm(args.pretrain)
    if args.packing_samples:
        check_packing(args.pretrain)
        if args.ref_pretrain:
            check_packing(args.ref_pretrain, "--ref_pretrain")
    check_lengths(args.pretrain, "--max_len", args.max_len, "--max_len")
    check_output_dir(args.output_dir)
    lora.check_args(args)
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5:
        raise UserError(f"--beta must be positive and --label_smoothing in [0, 0.5), got {args.beta} and "
                        f"{args.label_smoothing}.")
    check_loss_type(args)


def main(args: Args):
    check_args(args)
    # The batch sizes and the data are checked before the distributed world and DeepSpeed start; only rank 0
    # reports on the data.
    launcher_rank, launcher_world_size = launcher_world()
    args.zero_stage = trained_zero_stage(args.zero_stage, launcher_world_size, args.offload_optimizer,
                                         getattr(args, "load_in_4bit", False), args.offload_params)
    gradient_accumulation_steps(args.train_batch_size, args.micro_train_batch_size, launcher_world_size)
    ckpt_dir = checkpoint.checkpoint_dir(args)
    settings = checkpoint.trainer_settings(__file__, args, launcher_world_size, RUN_FLAGS)
    checkpoint.check_resume(ckpt_dir, settings, keep_last=args.keep_last_checkpoints)
    processor = vlm.load_processor(args.pretrain) if vlm.is_vision_language(args.pretrain) else None
    tokenizer = processor.tokenizer if processor else load_tokenizer(args.pretrain)
    uses_reference = args.loss_type not in REFERENCE_FREE
    if uses_reference:
        check_reference_tokenizer(args, tokenizer)

    def load_samples(source, split):
        rows = data.load_records(source, split)
        if processor:
            return vlm.build_vlm_preference_samples(rows, processor, source, args.input_key, args.chosen_key,
                                                    args.rejected_key, args.max_len,
                                                    log=lambda msg: print_rank0(launcher_rank, msg))
        vlm.check_takes_images(rows, args.input_key, source, args.pretrain)
        return data.build_preference_samples(rows, tokenizer, source, args.input_key, args.chosen_key,
                                             args.rejected_key, args.max_len, args.apply_chat_template,
                                             args.input_template, log=lambda msg: print_rank0(launcher_rank, msg))

    train_samples = load_samples(args.dataset, args.dataset_split)
    eval_samples = load_samples(args.eval_dataset, args.eval_dataset_split) if args.eval_dataset else []
    steps_per_epoch = data.steps_per_epoch(len(train_samples), args.train_batch_size, args.dataset, "pairs",
                                           lambda msg: print_rank0(launcher_rank, msg))
    widths = [data.padded_width(s) for s in train_samples]  # a step's micro-batches are cut shortest first
    total_steps = args.max_steps or steps_per_epoch * args.max_epochs
    checkpoint.check_not_past_end(ckpt_dir, total_steps)
    hold_output_folders(args.output_dir, ckpt_dir, rank=launcher_rank)

    rank, world_size, local_rank = init_distributed()
    settings["the number of ranks"] = world_size  # as formed: an MPI launch may set no WORLD_SIZE
    torch.manual_seed(args.seed)
    config = ds_config(args.zero_stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                       args.grad_clip, args.offload_optimizer, args.offload_params)

    model = load_model(args.pretrain, config, gradient_checkpointing=args.gradient_checkpointing,
                       torch_compile=args.torch_compile, **lora.load_kwargs(args))
    if processor and args.freeze_vision_tower:
        vlm.freeze_vision_tower(model)
    model = lora.wrap(model, args)  # unchanged without --lora_rank
    engine = init_train_engine(model, config, args.learning_rate, args.weight_decay, total_steps,
                               args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
    ref_engine = load_reference(args, world_size, rank) if uses_reference else None
    start_step = checkpoint.resume({"model": engine}, ckpt_dir, rank, settings)
    logger = MetricsLogger(args.output_dir, rank, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)

    bar = progress(total_steps, rank, "dpo", initial=start_step)
    for step in range(start_step, total_steps):
        epoch = step // steps_per_epoch
        lr = engine.get_lr()[0]  # the rate this step's update uses; the scheduler moves on after it
        step_batches = data.micro_batches(len(train_samples), args.train_batch_size, args.micro_train_batch_size,
                                          world_size, rank, args.seed, epoch, widths)[step % steps_per_epoch]
        names = ("loss", "chosen_rewards", "rejected_rewards", "correct", "chosen_logps", "rejected_logps", "pairs",
                 "ref_seconds", "aux_loss")  # sums over this step's pairs
        start, stats = time.time(), torch.zeros(len(names), device=device())
        # --nll_loss_coef: the chosen responses' token mean over the whole step, whatever its micro-batches and ranks
        chosen_tokens = torch.tensor(float(sum(sum(train_samples[i]["chosen"]["loss_mask"][1:])
                                               for indices in step_batches for i in indices)), device=device())
        dist.all_reduce(chosen_tokens)
        for indices in step_batches:
            batch = collate([train_samples[i] for i in indices], tokenizer, args.packing_samples, device(), processor)
            ref_start = time.time()
            ref_logps = ref_forward_logps(engine, ref_engine, batch) if uses_reference else None
            get_accelerator().synchronize()  # GPU kernels run asynchronously: time the work, not its launch
            ref_seconds = time.time() - ref_start
            chosen_logps, rejected_logps = forward_logps(engine, batch)
            losses, chosen_rewards, rejected_rewards = preference_losses(args, chosen_logps, rejected_logps,
                                                                         ref_logps, response_lengths(batch))
            # DeepSpeed averages the micro-batches and ranks: the NLL's shares of the step, scaled back
            loss = losses.mean() + nll_term(args, chosen_logps, chosen_tokens) * len(step_batches) * world_size
            aux = router_loss(engine)  # mixture of experts: the load-balancing term, where the config asks for it
            engine.backward(loss + aux)
            engine.step()
            stats += torch.tensor([losses.sum().item(), chosen_rewards.sum().item(), rejected_rewards.sum().item(),
                                   (chosen_rewards > rejected_rewards).sum().item(), chosen_logps.sum().item(),
                                   rejected_logps.sum().item(), len(indices), ref_seconds, float(aux) * len(indices)],
                                  device=stats.device)
        dist.all_reduce(stats)
        seconds, total = time.time() - start, dict(zip(names, stats.tolist()))
        pairs = total["pairs"]
        chosen_mean, rejected_mean = total["chosen_rewards"] / pairs, total["rejected_rewards"] / pairs
        metrics = {"train/loss": total["loss"] / pairs, "rewards/accuracies": total["correct"] / pairs,
                   "rewards/chosen": chosen_mean, "rewards/rejected": rejected_mean,
                   "rewards/margins": chosen_mean - rejected_mean,
                   "logps/chosen": total["chosen_logps"] / pairs, "logps/rejected": total["rejected_logps"] / pairs,
                   "train/lr": lr, "train/epoch": epoch, "perf/pairs_per_sec": pairs / seconds,
                   "perf/ref_forward_share": total["ref_seconds"] / world_size / seconds}
        if total["aux_loss"]:
            metrics["train/aux_loss"] = total["aux_loss"] / pairs
        if args.loss_type == "orpo" or args.nll_loss_coef:  # the term added to train/loss, per chosen token
            metrics["train/nll_loss"] = -total["chosen_logps"] / max(chosen_tokens.item(), 1)
        if args.eval_steps and (step + 1) % args.eval_steps == 0 and eval_samples:
            metrics.update(evaluate(engine, ref_engine, eval_samples, args, tokenizer, rank, world_size, processor))
        if (step + 1) % args.logging_steps == 0 or "eval/loss" in metrics:
            logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['rewards/accuracies']:.2f}")
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoint.save_train_state({"model": engine}, ckpt_dir, step + 1, {"step": step + 1}, rank,
                                        args.keep_last_checkpoints, settings=settings)
    bar.close()

    summary = {"train/loss": float(metrics["train/loss"])} if total_steps > start_step else {}
    if eval_samples:
        summary.update(evaluate(engine, ref_engine, eval_samples, args, tokenizer, rank, world_size, processor))
        logger.log(total_steps, summary)
    checkpoint.save_hf_model(engine, processor or tokenizer, args.output_dir, rank,
                             stop_ids=data.generation_stop_ids(tokenizer, args.apply_chat_template))
    logger.close()
    print_rank0(rank, f"saved the model to {args.output_dir} after {total_steps} steps: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))


if __name__ == "__main__":
    run_main(main, parse_args(Args),
             saved=lambda args: checkpoint.saved_note(checkpoint.checkpoint_dir(args)))
