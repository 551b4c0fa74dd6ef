#!/usr/bin/env bash
# DPO of an 8B Llama-architecture model: the SFT model from llama8b_8gpu_sft.sh learns from preference pairs directly,
# against a frozen copy of itself as the reference. No reward model, no sampling.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      about 30 min on A100s for one epoch of the 12.9k pairs below (the policy's forward and backward plus the
#           reference's forward); an estimate from the model's FLOPs, not a measurement.
# Set       SFT_MODEL, DATASET, OUT; WANDB_API_KEY to log online.
# Run       bash launch/llama8b_8gpu_dpo.sh [more flags]     (extra flags win; rerunning resumes)
#
# Variants: `--ipo` for IPO, `--label_smoothing 0.1` for conservative DPO, `--nll_loss_coef 0.2` to keep the chosen
# responses likely. The reference is partitioned with ZeRO-3 like the policy (1/8 of 16 GB per GPU); `--ref_offload`
# moves it to CPU memory if the GPUs are short. Watch rewards/accuracies and rewards/margins rise while logps/chosen
# does not fall far.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
DATASET=${DATASET:-Intel/orca_dpo_pairs}          # columns: system, question, chosen, rejected (all text)
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/dpo}

deepspeed --num_gpus 8 dpo.py \
    --pretrain "$SFT_MODEL" \
    --dataset "$DATASET" --dataset_split train \
    --input_key question --chosen_key chosen --rejected_key rejected \
    --input_template "$INPUT_TEMPLATE" \
    --max_len 2048 \
    --zero_stage 3 --gradient_checkpointing \
    --train_batch_size 128 --micro_train_batch_size 2 \
    --max_epochs 1 --learning_rate 5e-7 --warmup_ratio 0.03 \
    --beta 0.1 \
    --logging_steps 1 --save_steps 50 \
    --use_wandb --wandb_project llama8b-dpo \
    --output_dir "$OUT" \
    "$@"
