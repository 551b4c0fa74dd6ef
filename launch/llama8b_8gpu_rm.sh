#!/usr/bin/env bash
# Reward model for an 8B Llama-architecture policy: the SFT model from llama8b_8gpu_sft.sh with a scalar head,
# trained on preference pairs. PPO (llama8b_8gpu_ppo.sh) and rejection sampling score responses with it.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      about 20 min on A100s for one epoch of the 12.9k pairs below (two sequences of up to 2048 tokens each);
#           an estimate from the model's FLOPs, not a measurement.
# Set       SFT_MODEL (the policy the reward model will score; it must share its tokenizer), DATASET, OUT;
#           WANDB_API_KEY to log online.
# Run       bash launch/llama8b_8gpu_rm.sh [more flags]      (extra flags win; rerunning resumes)
#
# Watch eval/accuracy (add --eval_dataset FILE --eval_steps 50 with held-out pairs): on human preference data reward
# models typically rank 65-75% of held-out pairs right, and rewards/accuracies near 100% on training pairs with a
# flat eval/accuracy means memorising. The reward mean and std stored in the saved config.json are what ppo_ray.py
# and rejection_sampling.py normalise scores with.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
DATASET=${DATASET:-Intel/orca_dpo_pairs}          # columns: system, question, chosen, rejected (all text)
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/rm}

deepspeed --num_gpus 8 rm.py \
    --pretrain "$SFT_MODEL" \
    --dataset "$DATASET" --dataset_split train \
    --input_key question --chosen_key chosen --rejected_key rejected \
    --input_template "$INPUT_TEMPLATE" \
    --max_len 2048 \
    --zero_stage 3 --gradient_checkpointing \
    --train_batch_size 128 --micro_train_batch_size 4 \
    --max_epochs 1 --learning_rate 9e-6 --warmup_ratio 0.03 \
    --logging_steps 1 --save_steps 50 \
    --use_wandb --wandb_project llama8b-rm \
    --output_dir "$OUT" \
    "$@"
