"""Reward model (RM) training on preference pairs, with DeepSpeed ZeRO.

The second stage of RLHF (Ouyang et al. 2022, "Training language models to follow instructions"; Stiennon et al. 2020,
"Learning to summarize from human feedback"): a causal LM with a scalar head learns to score responses so that the
preferred one of each pair scores higher, with the Bradley-Terry loss -log sigmoid(r(x, y_w) - r(x, y_l)).
ppo_ray.py and rejection_sampling.py then optimise against its scores.

    deepspeed --num_gpus 2 rm.py --pretrain SFT_MODEL --dataset pairs.jsonl --apply_chat_template
    python rm.py ...                                    # one process, same flags

Implementation details, where they happen below:
  - the model is AutoModelForSequenceClassification with num_labels=1: the causal LM's backbone and a linear
    score head (new weights) in place of its LM head, so the saved model loads with plain transformers; with
    `--lora_rank` (common/lora.py) the backbone trains adapters on its frozen weights and the head trains whole;
  - every response is ended by an EOS (put back when truncation cuts it off, and what a chat template writes after
    it, such as ChatML's newline, cut off) and the reward is read there, at the last real token
    (common/modeling.py: sequence_rewards), the token sequence ppo_ray.py and rejection_sampling.py score;
    padding must then differ from EOS, so a tokenizer that pads with its EOS is given another pad token;
  - chosen and rejected responses go through the model in one forward pass, as one (2 x pairs, seq) batch;
  - `--packing_samples` concatenates that batch into one row with no padding; position_ids restart at each sequence
    so that each one attends only to itself, and the score head reads each one at its own last token
    (common/modeling.py: packed_sequence_rewards): the rewards and the loss are identical to the padded ones;
  - a "margin" in the data is subtracted inside the loss, as in Llama 2 (Touvron et al. 2023): pairs rated much
    better must be separated by more;
  - a pair whose chosen and rejected texts are identical carries no preference: it is skipped, with a warning;
  - after training, the mean and std of the rewards on the eval set (without one, on every n-th training pair,
    up to 1000 of them) are stored in config.json as reward_mean and reward_std, for consumers to normalise rewards;
  - a vision-language --pretrain (docs/vlm.md) gets a scalar head of common/vlm.py's on its backbone, since
    transformers has no sequence classifier for these families: its pairs' prompts hold images, which the forward
    reads, and its vision tower stays frozen unless `--freeze_vision_tower false`.

Load the result without this project's code:
    model = AutoModelForSequenceClassification.from_pretrained(out_dir)   # reward = model(**batch).logits[:, 0]
(the score is read at the last token that is not config.pad_token_id: right-pad with that id). A vision-language
reward model loads with common.vlm.sequence_classification_class(out_dir).from_pretrained(out_dir), its processor
with AutoProcessor; without this project, AutoModel.from_pretrained(out_dir) is its backbone and the safetensors'
`score.weight` its head, applied to the last hidden state at the EOS.
"""

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from common import checkpoint, data, lora, vlm
from common.args import (UserError, check_decoder_only, check_lengths, check_model_path, check_output_dir,
                         check_packing, parse_args, run_main)
from common.deepspeed_utils import (device, ds_config, gradient_accumulation_steps, init_distributed, init_train_engine,
                                    launcher_world, load_model, load_tokenizer, trained_zero_stage)
from common.logging_utils import MetricsLogger, print_rank0, progress
from common.modeling import packed_sequence_rewards, router_loss, sequence_rewards
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
    """held-out pairs in the same format, for the eval loss, the accuracy and the reward statistics"""
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
    output_dir: str = "out/rm"
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
    learning_rate: float = 9e-6
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
    wandb_project: str = "rlhf-rm"
    """wandb project name"""
    # --- reward model
    margin_key: str = data.DEFAULT_MARGIN_KEY
    """key of an optional per-pair margin the chosen reward must exceed the rejected one by (0 when absent)"""
    packing_samples: bool = False
    """pack each micro-batch into one row without padding"""
    freeze_vision_tower: bool = True
    """a vision-language model's vision tower keeps its weights (its connector, language model and head train); false
    trains it too"""


# A resumed run must match its checkpoint in these flags (what makes it this run: model, data, schedule), besides
# the batch size, seed, number of ranks, ZeRO stage and LoRA settings (checkpoint.trainer_settings).
RUN_FLAGS = ("pretrain", "dataset", "learning_rate", "warmup_ratio", "min_lr_ratio", "input_key", "chosen_key",
             "rejected_key", "apply_chat_template", "input_template", "max_len", "margin_key")


# ------------------------------------------------------------------------------------------------- ALGO LOGIC
def pairwise_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                  margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley-Terry loss of each pair: -log sigmoid(r_chosen - r_rejected - margin), (pairs,) -> (pairs,).

    OpenRLHF's LogExpLoss, log(1 + exp(r_rejected - r_chosen)), is this same function, so there is no choice to offer.
    """
    diff = chosen_rewards - rejected_rewards - (0.0 if margin is None else margin)
    return -F.logsigmoid(diff)


def forward_rewards(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of the chosen and of the rejected responses, read at each one's final EOS: (pairs,) each."""
    images = {k: v for k, v in batch.items() if k.startswith("pixel_")}  # a vision-language model's images
    if "position_ids" in batch:  # packed: one row, each sequence read at its own last token
        rewards = packed_sequence_rewards(model, batch["input_ids"], batch["position_ids"], **images)  # (2 * pairs,)
    else:
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], **images)  # (2 * pairs,)
    return rewards.chunk(2)
# --------------------------------------------------------------------------------------------- END ALGO LOGIC


def load_pairs(args: Args, tokenizer, source: str, split: str, log=print, processor=None) -> list[dict]:
    """Training or eval pairs, each response cut after its EOS, where the reward is read (common/data.py); with a
    vision-language model's processor, pairs whose prompts hold images (common/vlm.py)."""
    rows = data.load_records(source, split)
    if processor:
        return vlm.build_vlm_preference_samples(rows, processor, source, args.input_key, args.chosen_key,
                                                args.rejected_key, args.max_len, log, args.margin_key,
                                                end_with_eos=True)
    vlm.check_takes_images(rows, args.input_key, source, args.pretrain)
    return data.build_preference_samples(rows, tokenizer, source, args.input_key,
                                         args.chosen_key, args.rejected_key, args.max_len, args.apply_chat_template,
                                         args.input_template, args.margin_key, end_with_eos=True, log=log)


def collate(samples, tokenizer, packing: bool, dev, processor=None) -> dict:
    """Chosen responses then rejected ones, padded into one (2 * pairs, seq) batch or packed into one (1, total) row:
    one forward pass scores both."""
    sequences = [s["chosen"] for s in samples] + [s["rejected"] for s in samples]
    batch = data.pack_collate(sequences) if packing else data.pad_collate(sequences, tokenizer.pad_token_id)
    if processor is not None:
        batch.update(vlm.image_inputs(processor, sequences, packing))
    batch["margin"] = torch.tensor([s["margin"] for s in samples])  # (pairs,)
    return {k: v.to(dev) for k, v in batch.items()}


@torch.no_grad()
def evaluate(engine, samples, args, tokenizer, rank, world_size, processor=None) -> dict:
    """Mean loss, accuracy and the rewards' mean and std over the eval pairs, each rank taking every world_size-th."""
    engine.eval()
    names = ("loss", "correct", "pairs", "rewards", "squared_rewards")  # sums over pairs (rewards: both responses)
    stats = torch.zeros(len(names), device=device(), dtype=torch.float64)
    mine = samples[rank::world_size]
    for i in range(0, math.ceil(len(samples) / world_size), args.micro_train_batch_size):
        chunk = mine[i: i + args.micro_train_batch_size] or samples[:1]  # every rank runs the same number of steps
        weight = 1.0 if mine[i: i + args.micro_train_batch_size] else 0.0
        batch = collate(chunk, tokenizer, args.packing_samples, device(), processor)
        chosen_rewards, rejected_rewards = forward_rewards(engine, batch)
        losses = pairwise_loss(chosen_rewards, rejected_rewards, batch["margin"])
        rewards = torch.cat([chosen_rewards, rejected_rewards])
        stats += weight * torch.tensor([losses.sum().item(), (chosen_rewards > rejected_rewards).sum().item(),
                                        len(chunk), rewards.sum().item(), rewards.pow(2).sum().item()],
                                       device=device(), dtype=torch.float64)
    dist.all_reduce(stats)
    engine.train()
    total = dict(zip(names, stats.tolist()))
    mean = total["rewards"] / (2 * total["pairs"])
    std = math.sqrt(max(total["squared_rewards"] / (2 * total["pairs"]) - mean**2, 0.0))
    return {"eval/loss": total["loss"] / total["pairs"], "eval/accuracy": total["correct"] / total["pairs"],
            "eval/reward_mean": mean, "eval/reward_std": std}


def check_args(args: Args) -> None:
    """Refuse flag and model mistakes before anything loads."""
    check_model_path(args.pretrain)
    if not vlm.check_trainer_args(args):
        check_decoder_only(args.pretrain)  # the reward is read at the last token
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
    if tokenizer.pad_token_id == tokenizer.eos_token_id:  # the reward is read at the last token that is not padding
        spare = [t for t in (tokenizer.unk_token, tokenizer.bos_token) if t and t != tokenizer.eos_token]
        if not spare:
            raise UserError(f"the tokenizer of {args.pretrain} pads with its EOS token and has no other special token "
                            f"to pad with; add a pad token to it.")
        tokenizer.pad_token = spare[0]

    log = lambda msg: print_rank0(launcher_rank, msg)
    train_samples = load_pairs(args, tokenizer, args.dataset, args.dataset_split, log, processor)
    eval_samples = (load_pairs(args, tokenizer, args.eval_dataset, args.eval_dataset_split, log, processor)
                    if args.eval_dataset else [])
    steps_per_epoch = data.steps_per_epoch(len(train_samples), args.train_batch_size, args.dataset, "pairs", log)
    widths = [data.padded_width(s) for s in train_samples]  # a step's micro-batches are cut shortest first
    total_steps = args.max_steps or steps_per_epoch * args.max_epochs
    checkpoint.check_not_past_end(ckpt_dir, total_steps)
    hold_output_folders(args.output_dir, ckpt_dir, rank=launcher_rank)

    rank, world_size, local_rank = init_distributed()
    settings["the number of ranks"] = world_size  # as formed: an MPI launch may set no WORLD_SIZE
    torch.manual_seed(args.seed)
    config = ds_config(args.zero_stage, args.train_batch_size, args.micro_train_batch_size, world_size,
                       args.grad_clip, args.offload_optimizer, args.offload_params)

    model = load_model(args.pretrain, config, AutoModelForSequenceClassification, args.gradient_checkpointing,
                       torch_compile=args.torch_compile, num_labels=1, **lora.load_kwargs(args))
    # Set after the model is built: given to from_pretrained, it would become the embeddings' padding_idx, a row that
    # never gets a gradient, and where the EOS was the pad, that is now the BOS every row starts with.
    model.config.pad_token_id = tokenizer.pad_token_id  # transformers' own pooling reads the last non-pad token
    if processor and args.freeze_vision_tower:
        vlm.freeze_vision_tower(model)
    model = lora.wrap(model, args, "SEQ_CLS")  # with --lora_rank: adapters on the backbone, the new head trained whole
    engine = init_train_engine(model, config, args.learning_rate, args.weight_decay, total_steps,
                               args.warmup_ratio, args.min_lr_ratio, args.offload_optimizer)
    start_step = checkpoint.resume({"model": engine}, ckpt_dir, rank, settings)
    logger = MetricsLogger(args.output_dir, rank, vars(args), args.use_wandb, args.wandb_project,
                           resume_step=start_step)

    bar = progress(total_steps, rank, "rm", initial=start_step)
    for step in range(start_step, total_steps):
        epoch = step // steps_per_epoch
        lr = engine.get_lr()[0]  # the rate this step's update uses; the scheduler moves on after it
        step_batches = data.micro_batches(len(train_samples), args.train_batch_size, args.micro_train_batch_size,
                                          world_size, rank, args.seed, epoch, widths)[step % steps_per_epoch]
        names = ("loss", "chosen_rewards", "rejected_rewards", "correct", "pairs", "aux_loss")  # sums over the step
        start, stats = time.time(), torch.zeros(len(names), device=device())
        for indices in step_batches:
            batch = collate([train_samples[i] for i in indices], tokenizer, args.packing_samples, device(), processor)
            chosen_rewards, rejected_rewards = forward_rewards(engine, batch)
            losses = pairwise_loss(chosen_rewards, rejected_rewards, batch["margin"])
            aux = router_loss(engine)  # mixture of experts: the load-balancing term, where the config asks for it
            engine.backward(losses.mean() + aux)
            engine.step()
            stats += torch.tensor([losses.sum().item(), chosen_rewards.sum().item(), rejected_rewards.sum().item(),
                                   (chosen_rewards > rejected_rewards).sum().item(), len(indices),
                                   float(aux) * len(indices)], device=stats.device)
        dist.all_reduce(stats)
        seconds, total = time.time() - start, dict(zip(names, stats.tolist()))
        pairs = total["pairs"]
        chosen_mean, rejected_mean = total["chosen_rewards"] / pairs, total["rejected_rewards"] / pairs
        metrics = {"train/loss": total["loss"] / pairs, "rewards/accuracies": total["correct"] / pairs,
                   "rewards/chosen": chosen_mean, "rewards/rejected": rejected_mean,
                   "rewards/margins": chosen_mean - rejected_mean,
                   "train/lr": lr, "train/epoch": epoch, "perf/pairs_per_sec": pairs / seconds}
        if total["aux_loss"]:
            metrics["train/aux_loss"] = total["aux_loss"] / pairs
        if args.eval_steps and (step + 1) % args.eval_steps == 0 and eval_samples:
            metrics.update(evaluate(engine, eval_samples, args, tokenizer, rank, world_size, processor))
        if (step + 1) % args.logging_steps == 0 or "eval/loss" in metrics:
            logger.log(step + 1, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['rewards/accuracies']:.2f}")
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoint.save_train_state({"model": engine}, ckpt_dir, step + 1, {"step": step + 1}, rank,
                                        args.keep_last_checkpoints, settings=settings)
    bar.close()

    summary = {"train/loss": float(metrics["train/loss"])} if total_steps > start_step else {}
    # The reward statistics consumers normalise with: the eval set, or up to 1000 evenly spaced training pairs.
    stats_samples = eval_samples or train_samples[:: math.ceil(len(train_samples) / 1000)]
    final = evaluate(engine, stats_samples, args, tokenizer, rank, world_size, processor)
    if eval_samples:
        summary.update(final)
        logger.log(total_steps, summary)
    checkpoint.save_hf_model(engine, processor or tokenizer, args.output_dir, rank,
                             extra_config={"reward_mean": final["eval/reward_mean"],
                                           "reward_std": final["eval/reward_std"]})
    logger.close()
    print_rank0(rank, f"saved the model to {args.output_dir} after {total_steps} steps: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))


if __name__ == "__main__":
    run_main(main, parse_args(Args),
             saved=lambda args: checkpoint.saved_note(checkpoint.checkpoint_dir(args)))
