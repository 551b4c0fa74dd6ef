"""Kahneman-Tversky optimization (KTO) on unpaired good/bad feedback, with DeepSpeed ZeRO.

KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") learns from responses that
are each labelled desirable or undesirable, with no pairing: a response's implicit reward
r(x, y) = log(pi(y|x) / pi_ref(y|x)) is compared with a reference point z0, the policy's KL from the reference, and
the loss is 1 - sigmoid(beta * (r - z0)) for desirable responses and 1 - sigmoid(beta * (z0 - r)) for undesirable ones.

    deepspeed --num_gpus 2 kto.py --pretrain SFT_MODEL --dataset feedback.jsonl --apply_chat_template --beta 0.1
    python kto.py ...                                   # one process, same flags

Implementation details, where they happen below:
  - the reference model is the starting policy, frozen and partitioned with ZeRO-3 like the policy (`--ref_offload`
    keeps its parameters in CPU memory); its tokenizer must be the policy's. With `--lora_rank` (common/lora.py) the
    policy trains adapters on its frozen weights, and the reference is those weights with the adapters switched off:
    no second copy;
  - a response's log-prob is summed over its tokens only; prompt and padding are masked out (common/data.py);
  - z0 is estimated as in the paper: each prompt of a micro-batch is paired with the next sample's response, the
    mean log-ratio of these mismatched pairs is averaged across ranks and clamped at 0, and no gradient flows
    through it;
  - the samples and their mismatched pairs go through each model in one forward pass, as one (2 x batch, seq) batch;
  - `--packing_samples` concatenates that batch into one row with no padding; position_ids restart at each sequence
    so that each one attends only to itself, and each sequence's log-prob is summed over its own span of the row
    (common/modeling.py: sequence_sums): the log-probs and the loss are identical to the padded ones;
  - `--desirable_weight` / `--undesirable_weight` (lambda_D, lambda_U) rebalance skewed data; the paper advises
    lambda_D n_D / (lambda_U n_U) between 1 and 4/3, and the counts are printed at the start;
  - labels must be JSON booleans;
  - metrics are TRL's: rewards/{chosen,rejected,margins} over desirable and undesirable responses, objective/kl
    (z0); rewards/accuracies is the fraction of responses whose implicit reward has the sign of their label.
"""

import contextlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
    """training feedback: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    dataset_split: str = "train"
    """split to read when --dataset is a `datasets` name, a saved DatasetDict or a folder of per-split files"""
    eval_dataset: str | None = None
    """held-out feedback in the same format, for the eval loss and reward accuracy"""
    eval_dataset_split: str = "test"
    """split to read when --eval_dataset is a `datasets` name, a saved dataset or a folder of per-split files"""
    input_key: str = "prompt"
    """key of the prompt (text, or a list of chat messages)"""
    output_key: str = "response"
    """key of the response"""
    label_key: str = "label"
    """key of the label: true for a desirable response, false for an undesirable one"""
    apply_chat_template: bool = False
    """render prompts with the tokenizer's chat template"""
    input_template: str | None = None
    """a template such as 'Question: {} Answer: ' the prompt is formatted into (without a chat template)"""
    max_len: int = 512
    """each prompt + response is truncated to this many tokens"""
    output_dir: str = "out/kto"
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
    """samples per optimizer step, across all ranks"""
    micro_train_batch_size: int = 8
    """samples per forward pass on one rank (at least 2, for the mismatched pairs); the rest is gradient accumulation"""
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
    wandb_project: str = "rlhf-kto"
    """wandb project name"""
    # --- KTO
    ref_pretrain: str | None = None
    """the frozen reference model (default: --pretrain, which with --lora_rank is the policy with its adapters off)"""
    ref_offload: bool = False
    """keep the reference model's ZeRO-3 parameters in CPU memory"""
    beta: float = 0.1
    """scale of the implicit reward beta * log(pi / pi_ref): the strength of the pull towards the reference"""
    desirable_weight: float = 1.0
    """lambda_D: weight of the loss on desirable responses"""
    undesirable_weight: float = 1.0
    """lambda_U: weight of the loss on undesirable responses"""
    packing_samples: bool = False
    """pack each micro-batch into one row without padding"""
    freeze_vision_tower: bool = True
    """a vision-language model's vision tower keeps its weights (its connector and language model train); false
    trains it too"""


# A resumed run must match its checkpoint in these flags (what makes it this run: model, data, schedule), besides
# the batch size, seed, number of ranks, ZeRO stage and LoRA settings (checkpoint.trainer_settings).
RUN_FLAGS = ("pretrain", "ref_pretrain", "dataset", "beta", "learning_rate", "warmup_ratio", "min_lr_ratio",
             "input_key", "output_key", "label_key", "apply_chat_template", "input_template", "max_len",
             "desirable_weight", "undesirable_weight")


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor | float,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """KTO loss of each response, lambda_y - v(x, y) of the paper's section 4, and its implicit reward.

    policy_logps, ref_logps (batch,) are response log-probs summed over tokens, labels (batch,) bool (True:
    desirable), kl the reference point z0. Returns (losses, rewards), each (batch,); the rewards
    beta * log(pi / pi_ref) carry no gradient.
    """
    logratios = policy_logps - ref_logps
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return torch.where(labels, desirable_losses, undesirable_losses), beta * logratios.detach()


def kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, counts: bool = True) -> torch.Tensor:
    """z0: the mean log-ratio of the mismatched pairs, averaged across the ranks whose `counts` is set, clamped at 0,
    without gradient. evaluate's ranks with no eval samples left run a placeholder batch that must not count."""
    kl = (policy_kl_logps - ref_kl_logps).detach().mean()
    totals = torch.stack([kl * counts, torch.ones_like(kl) * counts])  # (kl sum, ranks counted)
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).clamp(min=0)


def forward_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the responses and of the mismatched pairs' responses, summed over tokens: (batch,) each."""
    images = {k: v for k, v in batch.items() if k.startswith("pixel_")}  # a vision-language model's images
    logprobs = next_token_logprobs(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"),
                                   response_start(batch["loss_mask"][:, 1:]),
                                   **images)  # (2 * batch, seq - 1), or (1, total - 1)
    logps = sequence_sums(logprobs * batch["loss_mask"][:, 1:], batch.get("position_ids"))  # (2 * batch,)
    return logps.chunk(2)


def ref_forward_logps(engine, ref_engine, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_logps of the frozen reference: its own engine, or without one (LoRA) the policy's adapters off."""
    with torch.no_grad(), lora.reference(engine) if ref_engine is None else contextlib.nullcontext():
        return forward_logps(ref_engine or engine, batch)
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


def collate(samples, tokenizer, max_len, packing: bool, dev, partners=None, processor=None) -> dict:
    """The samples, then each prompt with another sample's response (KTO's mismatched pairs; `partners` gives the
    responses instead), padded into one (2 * batch, seq) batch or packed into one (1, total) row: one forward pass
    scores both. A vision-language model's pair keeps its prompt's images."""
    partners = partners or mismatched_partners(samples)
    mismatched = [vlm.mismatched_pair(processor, sample, other, max_len) if processor else
                  data.mismatched_pair(tokenizer, sample, other, max_len) for sample, other in zip(samples, partners)]
    sequences = samples + mismatched
    batch = data.pack_collate(sequences) if packing else data.pad_collate(sequences, tokenizer.pad_token_id)
    if processor is not None:
        batch.update(vlm.image_inputs(processor, sequences, packing))
    batch["labels"] = torch.tensor([s["label"] for s in samples])  # (batch,)
    return {k: v.to(dev) for k, v in batch.items()}


def mismatched_partners(samples: list[dict]) -> list[dict]:
    """Whose response each sample's prompt is paired with: the samples rotated by the smallest shift that pairs no
    prompt with a response to the same prompt (else by the one that pairs the fewest). A response to the same prompt,
    such as a preference pair's other side on the next line, is no mismatched pair: its reward would pull the KL
    estimate z0 towards that of the matched samples."""
    n = len(samples)
    same = lambda k: sum(samples[i]["prompt_text"] == samples[(i + k) % n]["prompt_text"] for i in range(n))
    shift = min(range(1, n), key=lambda k: (same(k), k)) if n > 1 else 0
    return samples[shift:] + samples[:shift]


@torch.no_grad()
def evaluate(engine, ref_engine, samples, args, tokenizer, rank, world_size, processor=None) -> dict:
    """Mean loss, reward accuracy and reward margin over the eval samples, each rank taking every world_size-th one."""
    engine.eval()
    names = ("loss", "correct", "chosen_rewards", "chosen", "rejected_rewards", "rejected")  # sums over samples
    stats = torch.zeros(len(names), device=device())
    # in a fixed shuffled order, the same on every rank: a file's consecutive lines often share a prompt
    samples = random.Random(args.seed).sample(samples, len(samples))
    mine = samples[rank::world_size]
    for i in range(0, math.ceil(len(samples) / world_size), args.micro_train_batch_size):
        chunk = mine[i: i + args.micro_train_batch_size] or samples[:2]  # every rank runs the same number of steps
        counts = bool(mine[i: i + args.micro_train_batch_size])
        # a lone sample would be its own partner: z0 would be its own reward. Another eval sample's response,
        # to another prompt where there is one
        others = [s for s in samples if s is not chunk[0]]
        partners = [next((s for s in others if s["prompt_text"] != chunk[0]["prompt_text"]), others[0])] \
            if len(chunk) == 1 else None
        batch = collate(chunk, tokenizer, args.max_len, args.packing_samples, device(), partners, processor)
        (logps, kl_logps) = forward_logps(engine, batch)
        ref_logps, ref_kl_logps = ref_forward_logps(engine, ref_engine, batch)
        kl = kl_reference_point(kl_logps, ref_kl_logps, counts)
        labels = batch["labels"]
        losses, rewards = kto_loss(logps, ref_logps, labels, kl, args.beta, args.desirable_weight,
                                   args.undesirable_weight)
        correct = torch.where(labels, rewards > 0, rewards < 0)  # the implicit reward has the label's sign
        stats += counts * torch.tensor([losses.sum().item(), correct.sum().item(), rewards[labels].sum().item(),
                                        labels.sum().item(), rewards[~labels].sum().item(), (~labels).sum().item()],
                                       device=device())
    dist.all_reduce(stats)
    engine.train()
    total = dict(zip(names, stats.tolist()))
    samples_seen = total["chosen"] + total["rejected"]
    return {"eval/loss": total["loss"] / samples_seen, "eval/rewards/accuracies": total["correct"] / samples_seen,
            "eval/rewards/margins": total["chosen_rewards"] / max(total["chosen"], 1)
            - total["rejected_rewards"] / max(total["rejected"], 1)}


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
    if args.beta <= 0 or args.desirable_weight < 0 or args.undesirable_weight < 0:
        raise UserError(f"--beta must be positive and the weights non-negative, got --beta {args.beta}, "
                        f"--desirable_weight {args.desirable_weight}, --undesirable_weight {args.undesirable_weight}.")
    if args.micro_train_batch_size < 2:
        raise UserError("KTO pairs each prompt with another sample's response to estimate its KL reference point; "
                        "set --micro_train_batch_size to 2 or more.")


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
    check_reference_tokenizer(args, tokenizer)

    def load_samples(source, split):
        rows = data.load_records(source, split)
        if processor:
            return vlm.build_vlm_kto_samples(rows, processor, source, args.input_key, args.output_key,
                                             args.label_key, args.max_len,
                                             log=lambda msg: print_rank0(launcher_rank, msg))
        vlm.check_takes_images(rows, args.input_key, source, args.pretrain)
        return data.build_kto_samples(rows, tokenizer, source, args.input_key, args.output_key, args.label_key,
                                      args.max_len, args.apply_chat_template, args.input_template,
                                      log=lambda msg: print_rank0(launcher_rank, msg))

    train_samples = load_samples(args.dataset, args.dataset_split)
    eval_samples = load_samples(args.eval_dataset, args.eval_dataset_split) if args.eval_dataset else []
    if len(eval_samples) == 1:
        raise data.DataError(f"{args.eval_dataset} has 1 usable sample; KTO's reference point pairs each prompt with "
                             "another sample's response, so give an eval set of at least 2.")
    steps_per_epoch = data.steps_per_epoch(len(train_samples), args.train_batch_size, args.dataset, "samples",
                                           lambda msg: print_rank0(launcher_rank, msg))
    total_steps = args.max_steps or steps_per_epoch * args.max_epochs
    checkpoint.check_not_past_end(ckpt_dir, total_steps)
    hold_output_folders(args.output_dir, ckpt_dir, rank=launcher_rank)

    rank, world_size, local_rank = init_distributed()
    settings["the number of ranks"] = world_size  # as formed: an MPI launch may set no WORLD_SIZE
    torch.manual_seed(args.seed)
    config = ds_config(args.zero_stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                       args.grad_clip, args.offload_optimizer, args.offload_params)
    desirable = sum(s["label"] for s in train_samples)
    undesirable = len(train_samples) - desirable
    print_rank0(rank, f"{desirable} desirable and {undesirable} undesirable responses: lambda_D n_D / (lambda_U n_U) = "
                      f"{args.desirable_weight * desirable / max(args.undesirable_weight * undesirable, 1e-9):.2f} "
                      f"(the KTO paper advises 1 to 4/3)")

    model = load_model(args.pretrain, config, gradient_checkpointing=args.gradient_checkpointing,
                       torch_compile=args.torch_compile, **lora.load_kwargs(args))
    if processor and args.freeze_vision_tower:
        vlm.freeze_vision_tower(model)
    model = lora.wrap(model, args)  # unchanged without --lora_rank
    engine = init_train_engine(model, config, args.learning_rate, args.weight_decay, total_steps,
                               args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
    ref_engine = load_reference(args, world_size, rank)
    start_step = checkpoint.resume({"model": engine}, ckpt_dir, rank, settings)
    logger = MetricsLogger(args.output_dir, rank, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)

    bar = progress(total_steps, rank, "kto", initial=start_step)
    for step in range(start_step, total_steps):
        epoch = step // steps_per_epoch
        lr = engine.get_lr()[0]  # the rate this step's update uses; the scheduler moves on after it
        step_batches = data.micro_batches(len(train_samples), args.train_batch_size, args.micro_train_batch_size,
                                          world_size, rank, args.seed, epoch)[step % steps_per_epoch]
        names = ("loss", "kl", "correct", "chosen_rewards", "chosen_logps", "chosen", "rejected_rewards",
                 "rejected_logps", "rejected", "micro_batches", "ref_seconds", "aux_loss")  # sums over the step
        start, stats = time.time(), torch.zeros(len(names), device=device())
        for indices in step_batches:
            batch = collate([train_samples[i] for i in indices], tokenizer, args.max_len, args.packing_samples,
                            device(), processor=processor)
            ref_start = time.time()
            ref_logps, ref_kl_logps = ref_forward_logps(engine, ref_engine, batch)
            get_accelerator().synchronize()  # GPU kernels run asynchronously: time the work, not its launch
            ref_seconds = time.time() - ref_start
            logps, kl_logps = forward_logps(engine, batch)
            kl = kl_reference_point(kl_logps, ref_kl_logps)
            labels = batch["labels"]
            losses, rewards = kto_loss(logps, ref_logps, labels, kl, args.beta, args.desirable_weight,
                                       args.undesirable_weight)
            aux = router_loss(engine)  # mixture of experts: the load-balancing term, where the config asks for it
            engine.backward(losses.mean() + aux)
            engine.step()
            correct = torch.where(labels, rewards > 0, rewards < 0)  # the implicit reward has the label's sign
            stats += torch.tensor([losses.sum().item(), kl.item(), correct.sum().item(), rewards[labels].sum().item(),
                                   logps[labels].sum().item(), labels.sum().item(), rewards[~labels].sum().item(),
                                   logps[~labels].sum().item(), (~labels).sum().item(), 1, ref_seconds, float(aux)],
                                  device=stats.device)
        dist.all_reduce(stats)
        seconds, total = time.time() - start, dict(zip(names, stats.tolist()))
        samples_seen = total["chosen"] + total["rejected"]
        chosen, rejected = max(total["chosen"], 1), max(total["rejected"], 1)  # desirable / undesirable responses
        metrics = {"train/loss": total["loss"] / samples_seen, "rewards/chosen": total["chosen_rewards"] / chosen,
                   "rewards/rejected": total["rejected_rewards"] / rejected,
                   "rewards/accuracies": total["correct"] / samples_seen,
                   "rewards/margins": total["chosen_rewards"] / chosen - total["rejected_rewards"] / rejected,
                   "logps/chosen": total["chosen_logps"] / chosen, "logps/rejected": total["rejected_logps"] / rejected,
                   "objective/kl": total["kl"] / total["micro_batches"], "train/lr": lr,
                   "train/epoch": epoch, "perf/samples_per_sec": samples_seen / seconds,
                   "perf/ref_forward_share": total["ref_seconds"] / world_size / seconds}
        if total["aux_loss"]:
            metrics["train/aux_loss"] = total["aux_loss"] / total["micro_batches"]
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
