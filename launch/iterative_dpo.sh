#!/usr/bin/env bash
# Iterative (online) DPO of an 8B Llama-architecture model (Xiong et al. 2024), for 3 rounds: each round samples 8
# responses per prompt from the current model with vLLM, scores them with the reward model from llama8b_8gpu_rm.sh,
# pairs the best response of each prompt (chosen) with the worst (rejected), and runs dpo.py on those pairs; the next
# round samples from the model just trained.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      per round, roughly 15 min of sampling, 1-2 h of scoring (the reward model scores on one GPU) and
#           20 min of DPO; estimates, not measurements.
# Set       SFT_MODEL, RM_MODEL, PROMPTS, PROMPT_SPLIT, OUT; WANDB_API_KEY to log online.
# Run       bash launch/iterative_dpo.sh [more flags]   (extra flags win)
#
# Each round's DPO reference is the model that round started from (dpo.py's default --ref_pretrain is --pretrain), so
# every round takes a step of bounded size away from the last one. Prompts whose 8 samples all score the same give no
# pair and are skipped (logged as data/prompts_skipped). Output: $OUT/iter_K/{generations,scored,dpo_pairs}.jsonl
# and $OUT/iter_K/model; rerunning the same command resumes in the round it stopped in.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
RM_MODEL=${RM_MODEL:-out/llama8b/rm}
PROMPTS=${PROMPTS:-HuggingFaceH4/ultrachat_200k}   # column: prompt (text)
PROMPT_SPLIT=${PROMPT_SPLIT:-train_gen}
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/iterative_dpo}

python rejection_sampling.py \
    --pretrain "$SFT_MODEL" \
    --dataset "$PROMPTS" --dataset_split "$PROMPT_SPLIT" --input_key prompt \
    --input_template "$INPUT_TEMPLATE" \
    --prompts_per_iteration 10000 \
    --reward_pretrain "$RM_MODEL" \
    --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.9 \
    --max_model_len 4096 --generate_max_len 1024 \
    --n_samples_per_prompt 8 --temperature 1.0 --top_p 1.0 \
    --reward_batch_size 64 \
    --mode dpo_pairs \
    --iterations 3 --train_num_gpus 8 \
    --train_args "--beta 0.1 --learning_rate 5e-7 --zero_stage 3 --gradient_checkpointing --max_len 4096 --train_batch_size 128 --micro_train_batch_size 2 --max_epochs 1 --save_steps 20" \
    --use_wandb --wandb_project llama8b-iterative-dpo \
    --output_dir "$OUT" \
    "$@"
