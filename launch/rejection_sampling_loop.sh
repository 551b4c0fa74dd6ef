#!/usr/bin/env bash
# Rejection sampling fine-tuning (best-of-n, as in Llama 2 and RAFT) of an 8B Llama-architecture model, for 3 rounds:
# each round samples 8 responses per prompt from the current model with vLLM, scores them with the reward model from
# llama8b_8gpu_rm.sh, keeps the best response of each prompt and runs sft.py on those; the next round samples from
# the model just trained.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      per round, roughly 15 min of sampling (10k prompts x 8 samples on 8 vLLM engines), 1-2 h of scoring
#           (the reward model scores on one GPU) and 15 min of SFT; estimates, not measurements.
# Set       SFT_MODEL, RM_MODEL, PROMPTS, PROMPT_SPLIT, OUT; WANDB_API_KEY to log online.
# Run       bash launch/rejection_sampling_loop.sh [more flags]   (extra flags win)
#
# Output: $OUT/iter_K/{generations,scored,best_of_n}.jsonl and $OUT/iter_K/model for K = 0, 1, 2; the last
# iteration's model is the result. Rerunning the same command after a crash resumes in the round it stopped in,
# reusing the samples already generated and scored.
# One round by hand: --iterations 0 writes $OUT/best_of_n.jsonl and trains nothing; train on it with sft.py.
# With a rule-based reward instead of a reward model (checkable answers), replace --reward_pretrain with
# --reward_fn path/to/file.py:function and add --min_reward 1.0 to keep only solved prompts (RAFT's filter).
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
RM_MODEL=${RM_MODEL:-out/llama8b/rm}
PROMPTS=${PROMPTS:-HuggingFaceH4/ultrachat_200k}   # column: prompt (text)
PROMPT_SPLIT=${PROMPT_SPLIT:-train_gen}
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/rejection_sampling}

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
    --mode best_of_n \
    --iterations 3 --train_num_gpus 8 \
    --train_args "--zero_stage 3 --gradient_checkpointing --max_len 4096 --train_batch_size 128 --micro_train_batch_size 4 --learning_rate 5e-6 --max_epochs 1 --save_steps 20" \
    --use_wandb --wandb_project llama8b-rejection-sampling \
    --output_dir "$OUT" \
    "$@"
