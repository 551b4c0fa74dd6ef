#!/usr/bin/env bash
# SFT of an 8B Llama-architecture model on instruction data: the first stage, whose output every later stage
# (llama8b_8gpu_rm.sh, _dpo.sh, _kto.sh, _ppo.sh) starts from.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      about 2 h on A100s, 1 h on H100s for the 200k samples below. These are estimates from the model's FLOPs
#           (~15k trained tokens/s on 8 A100s), not measurements.
# Set       MODEL, DATASET, DATASET_SPLIT, OUT (defaults below); HF_TOKEN for the gated Llama weights;
#           WANDB_API_KEY to log to Weights & Biases online (without it --use_wandb logs offline into $OUT).
# Run       bash launch/llama8b_8gpu_sft.sh [more flags]      in the project's environment (source .venv/bin/activate);
#           flags given on the command line come last and win. Rerunning the same command resumes from the last
#           checkpoint (--save_steps).
#
# Memory: ZeRO-3 splits weights, gradients and Adam states over the 8 GPUs (~16 GB each for 8B), gradient
# checkpointing keeps activations small, and packing fills each micro-batch with up to 4 x 2048 tokens and no padding.
# Templates: a base model's tokenizer may have no chat template, so prompts go through --input_template. For a chat
# model, use --apply_chat_template instead, here and in every later stage (they must render prompts the same way).
# Several nodes: `deepspeed --hostfile hostfile sft.py ...` with the same flags (see launch/ray_cluster_manual.md).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-meta-llama/Llama-3.1-8B}
DATASET=${DATASET:-Open-Orca/OpenOrca}            # columns: question, response (system_prompt is not used)
DATASET_SPLIT=${DATASET_SPLIT:-train[:200000]}    # a `datasets` split slice: the first 200k of its 4M rows
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}
OUT=${OUT:-out/llama8b/sft}

deepspeed --num_gpus 8 sft.py \
    --pretrain "$MODEL" \
    --dataset "$DATASET" --dataset_split "$DATASET_SPLIT" \
    --input_key question --output_key response \
    --input_template "$INPUT_TEMPLATE" \
    --max_len 2048 \
    --zero_stage 3 --gradient_checkpointing --packing_samples \
    --train_batch_size 128 --micro_train_batch_size 4 \
    --max_epochs 1 --learning_rate 5e-6 --warmup_ratio 0.03 --min_lr_ratio 0.1 \
    --logging_steps 1 --save_steps 200 --keep_last_checkpoints 2 \
    --use_wandb --wandb_project llama8b-sft \
    --output_dir "$OUT" \
    "$@"
