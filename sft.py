"""Supervised fine-tuning (SFT) and continued pretraining of a Hugging Face causal LM with DeepSpeed ZeRO.

The first stage of RLHF (Ouyang et al. 2022, "Training language models to follow instructions"): teach the model
the response format by maximising the likelihood of demonstration responses given their prompts.

    deepspeed --num_gpus 2 sft.py --pretrain MODEL --dataset data.jsonl --apply_chat_template
    python sft.py ...                                   # one process, same flags

Implementation details, where they happen below:
  - the loss is the mean negative log-likelihood over response tokens only; prompt tokens are masked out, and in a
    multi-turn conversation every assistant turn is trained on (common/data.py builds the mask);
  - `--pretrain_mode` trains on every token instead (continued pretraining on raw text);
  - `--packing_samples` concatenates a micro-batch into one row with no padding; position_ids restart at each
    sample so that each one attends only to itself, and the loss is identical to the padded loss;
  - the data order is a function of (seed, epoch), so a run resumed from its last checkpoint sees exactly the
    batches the uninterrupted run would have seen.
"""

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common import checkpoint, data, lora, vlm
from common.args import (check_causal_lm, check_lengths, check_model_path, check_output_dir, check_packing, parse_args,
                         run_main)
from common.deepspeed_utils import (device, ds_config, gradient_accumulation_steps, init_distributed, init_train_engine,
                                    launcher_world, load_model, load_tokenizer, trained_zero_stage)
from common.logging_utils import MetricsLogger, print_rank0, progress
from common.modeling import next_token_logprobs, response_start, router_loss
from common.output_lock import hold_output_folders


@dataclass
class Args:
    # --- model and data
    pretrain: str = ""
    """the model to start from: a Hugging Face model folder or hub name"""
    dataset: str = ""
    """training data: a .jsonl/.json/.parquet file, a folder of them, or a `datasets` name"""
    dataset_split: str = "train"
    """split to read when --dataset is a `datasets` name, a saved DatasetDict or a folder of per-split files"""
    eval_dataset: str | None = None
    """held-out data in the same format, for the eval loss"""
    eval_dataset_split: str = "test"
    """split to read when --eval_dataset is a `datasets` name, a saved dataset or a folder of per-split files"""
    input_key: str = "prompt"
    """key of the prompt (text, or a list of chat messages); in --pretrain_mode, the key of the text"""
    output_key: str = "response"
    """key of the response; rows with a list of messages under --input_key and no response are multi-turn chats"""
    apply_chat_template: bool = False
    """render prompts with the tokenizer's chat template"""
    input_template: str | None = None
    """a template such as 'Question: {} Answer: ' the prompt is formatted into (without a chat template)"""
    max_len: int = 512
    """samples are truncated to this many tokens"""
    output_dir: str = "out/sft"
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
    """samples per forward pass on one rank; the rest is gradient accumulation"""
    max_epochs: int = 1
    """passes over the training data"""
    max_steps: int = 0
    """stop after this many optimizer steps (0: run --max_epochs)"""
    learning_rate: float = 5e-6
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
    """compute the eval loss every this many steps (0: only at the end)"""
    save_steps: int = 0
    """save a resumable checkpoint every this many steps (0: never)"""
    ckpt_dir: str | None = None
    """where resumable checkpoints go (default: <output_dir>/checkpoints); a run resumes from the latest one"""
    keep_last_checkpoints: int = 2
    """how many resumable checkpoints to keep"""
    use_wandb: bool = False
    """also log to Weights & Biases (offline without WANDB_API_KEY)"""
    wandb_project: str = "rlhf-sft"
    """wandb project name"""
    # --- SFT
    pretrain_mode: bool = False
    """continued pretraining: train on every token of the text under --input_key"""
    packing_samples: bool = False
    """pack each micro-batch into one row without padding"""
    freeze_vision_tower: bool = True
    """a vision-language model's vision tower keeps its weights (its connector and language model train); false
    trains it too"""


# A resumed run must match its checkpoint in these flags (what makes it this run: model, data, schedule), besides
# the batch size, seed, number of ranks, ZeRO stage and LoRA settings (checkpoint.trainer_settings).
RUN_FLAGS = ("pretrain", "dataset", "learning_rate", "warmup_ratio", "min_lr_ratio", "input_key", "output_key",
             "apply_chat_template", "input_template", "max_len", "pretrain_mode")


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, tokens: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens: their sum over `tokens`, the trained tokens of the whole
    batch this micro-batch belongs to (default: its own), so that every token of an optimizer step weighs the same
    whichever micro-batch and rank it falls in.

    logprobs (batch, seq - 1) are next-token log-probs (entry t predicts token t + 1), loss_mask (batch, seq).
    """
    mask = loss_mask[:, 1:].to(logprobs.dtype)
    return -(logprobs * mask).sum() / (mask.sum() if tokens is None else torch.as_tensor(tokens)).clamp(min=1)


def forward_logprobs(model, batch: dict) -> torch.Tensor:
    """Next-token log-probs for a padded or a packed batch; 0 before its loss mask's first trained token."""
    start = response_start(batch["loss_mask"][:, 1:]) if "loss_mask" in batch else 0
    images = {k: v for k, v in batch.items() if k.startswith("pixel_")}  # a vision-language model's images
    return next_token_logprobs(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"), start,
                               **images)
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


def collate(samples, tokenizer, packing: bool, dev, processor=None) -> dict:
    batch = data.pack_collate(samples) if packing else data.pad_collate(samples, tokenizer.pad_token_id)
    if processor is not None:
        batch.update(vlm.image_inputs(processor, samples, packing))
    return {k: v.to(dev) for k, v in batch.items()}


@torch.no_grad()
def evaluate(engine, samples, args, tokenizer, rank, world_size, processor=None) -> float:
    """Token-level mean NLL over the eval set, each rank taking every world_size-th sample."""
    engine.eval()
    total = torch.zeros(2, device=device())  # (sum of NLL, number of tokens)
    mine = samples[rank::world_size]
    # Under ZeRO-3 every forward is collective: all ranks run as many passes as the rank with the most samples.
    for i in range(0, math.ceil(len(samples) / world_size), args.micro_train_batch_size):
        chunk = mine[i: i + args.micro_train_batch_size] or samples[:1]  # every rank runs the same number of steps
        weight = 1.0 if mine[i: i + args.micro_train_batch_size] else 0.0
        batch = collate(chunk, tokenizer, args.packing_samples, device(), processor)
        logprobs = forward_logprobs(engine, batch)
        mask = batch["loss_mask"][:, 1:].float()
        total += weight * torch.stack([-(logprobs * mask).sum(), mask.sum()])
    dist.all_reduce(total)
    engine.train()
    return (total[0] / total[1].clamp(min=1)).item()


def check_args(args: Args) -> None:
    """Refuse flag and model mistakes before anything loads."""
    check_model_path(args.pretrain)
    if not vlm.check_trainer_args(args):
        check_causal_lm(args.pretrain)
    if args.packing_samples:
        check_packing(args.pretrain)
    check_lengths(args.pretrain, "--max_len", args.max_len, "--max_len")
    check_output_dir(args.output_dir)
    lora.check_args(args)


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

    def load_samples(source, split):
        rows = data.load_records(source, split)
        if processor:
            return vlm.build_vlm_sft_samples(rows, processor, source, args.input_key, args.output_key,
                                             args.max_len, log=lambda msg: print_rank0(launcher_rank, msg))
        vlm.check_takes_images(rows, args.input_key, source, args.pretrain)
        return data.build_sft_samples(rows, tokenizer, source, args.input_key, args.output_key, args.max_len,
                                      args.apply_chat_template, args.input_template, args.pretrain_mode,
                                      log=lambda msg: print_rank0(launcher_rank, msg))

    train_samples = load_samples(args.dataset, args.dataset_split)
    eval_samples = load_samples(args.eval_dataset, args.eval_dataset_split) if args.eval_dataset else []
    steps_per_epoch = data.steps_per_epoch(len(train_samples), args.train_batch_size, args.dataset, "samples",
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

    model = load_model(args.pretrain, config, gradient_checkpointing=args.gradient_checkpointing, dropout=True,
                       torch_compile=args.torch_compile, **lora.load_kwargs(args))
    if processor and args.freeze_vision_tower:
        vlm.freeze_vision_tower(model)
    model = lora.wrap(model, args)  # unchanged without --lora_rank
    engine = init_train_engine(model, config, args.learning_rate, args.weight_decay, total_steps,
                               args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
    start_step = checkpoint.resume({"model": engine}, ckpt_dir, rank, settings)
    logger = MetricsLogger(args.output_dir, rank, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)

    bar = progress(total_steps, rank, "sft", initial=start_step)
    for step in range(start_step, total_steps):
        epoch = step // steps_per_epoch
        lr = engine.get_lr()[0]  # the rate this step's update uses; the scheduler moves on after it
        step_batches = data.micro_batches(len(train_samples), args.train_batch_size, args.micro_train_batch_size,
                                          world_size, rank, args.seed, epoch, widths)[step % steps_per_epoch]
        start, stats = time.time(), torch.zeros(4, device=device())  # (loss sum, micro-batches, real tokens, aux sum)
        # DeepSpeed averages the micro-batches' losses over the step's micro-batches and ranks: each loss is its
        # share of the step's token mean, times what that average divides by
        tokens = torch.tensor(float(sum(sum(train_samples[i]["loss_mask"][1:]) for indices in step_batches
                                        for i in indices)), device=device())
        dist.all_reduce(tokens)
        scale = len(step_batches) * world_size
        for indices in step_batches:
            batch = collate([train_samples[i] for i in indices], tokenizer, args.packing_samples, device(), processor)
            loss = sft_loss(forward_logprobs(engine, batch), batch["loss_mask"], tokens) * scale
            aux = router_loss(engine)  # mixture of experts: the load-balancing term, where the config asks for it
            engine.backward(loss + aux)
            engine.step()
            real_tokens = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
            # summed on the device: reading a loss here would make the CPU wait for the GPU at every micro-batch
            stats += torch.stack([loss.detach(), torch.ones_like(loss), torch.as_tensor(real_tokens).to(loss),
                                  torch.as_tensor(aux).to(loss).detach()])
        dist.all_reduce(stats)
        loss_sum, micro_batches, step_tokens, aux_sum = stats.tolist()  # waits for the step's GPU work: timed whole
        metrics = {"train/loss": loss_sum / micro_batches, "train/lr": lr, "train/epoch": epoch,
                   "perf/tokens_per_sec": step_tokens / (time.time() - start)}
        if aux_sum:
            metrics["train/aux_loss"] = aux_sum / micro_batches
        if args.eval_steps and (step + 1) % args.eval_steps == 0 and eval_samples:
            metrics["eval/loss"] = evaluate(engine, eval_samples, args, tokenizer, rank, world_size, processor)
        if (step + 1) % args.logging_steps == 0 or "eval/loss" in metrics:
            logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoint.save_train_state({"model": engine}, ckpt_dir, step + 1, {"step": step + 1}, rank,
                                        args.keep_last_checkpoints, settings=settings)
    bar.close()

    summary = {"train/loss": float(metrics["train/loss"])} if total_steps > start_step else {}
    if eval_samples:
        summary["eval/loss"] = evaluate(engine, eval_samples, args, tokenizer, rank, world_size, processor)
        logger.log(total_steps, summary)
    checkpoint.save_hf_model(engine, processor or tokenizer, args.output_dir, rank,
                             stop_ids=data.generation_stop_ids(tokenizer, args.apply_chat_template))
    logger.close()
    print_rank0(rank, f"saved the model to {args.output_dir} after {total_steps} steps: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))


if __name__ == "__main__":
    run_main(main, parse_args(Args),
             saved=lambda args: checkpoint.saved_note(checkpoint.checkpoint_dir(args)))
