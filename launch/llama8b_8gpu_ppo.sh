#!/usr/bin/env bash
# PPO of an 8B Llama-architecture model on one 8-GPU node: the SFT model from llama8b_8gpu_sft.sh is the actor and
# the reference, the reward model from llama8b_8gpu_rm.sh scores the rollouts and initialises the critic.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 512 GB of CPU memory (the actor's and critic's Adam states,
#           ~100 GB each, live there).
# Time      roughly 2-4 min per PPO step of 512 rollouts of up to 1024 tokens, so 7-13 h for the 200 steps below;
#           an estimate from the FLOPs and vLLM's usual throughput, not a measurement.
# Set       SFT_MODEL, RM_MODEL, PROMPTS, PROMPT_SPLIT, OUT; WANDB_API_KEY to log online.
# Run       bash launch/llama8b_8gpu_ppo.sh [more flags]     (extra flags win; rerunning resumes from --save_steps)
#
# Layout (8 GPUs; ppo_ray.py starts a local Ray cluster when no --ray_address is given; $OUT/placement.json records
# where each worker ran):
#   4 GPUs  actor, 4 ZeRO-3 ranks, with the reference colocated on the same GPUs (it takes ~4 GB of each)
#   2 GPUs  critic, 2 ZeRO-3 ranks, with the reward model colocated
#   2 GPUs  2 vLLM engines, one GPU each, which take the actor's weights after every step
# --ref_num_workers / --reward_num_workers match the actor / critic: colocated roles get one worker per GPU of the
# role they sit with. --offload_optimizer keeps the critic (8B on 2 GPUs) within 80 GB. The experience phase's
# forwards need no gradients and run 8 responses at a time (--micro_rollout_batch_size), twice the training micro-batch.
# Critic-free variants: --advantage_estimator reinforce++ (or grpo / rloo with --n_samples_per_prompt 4 or more)
# start no critic, leaving its 2 GPUs to the reward model alone.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
RM_MODEL=${RM_MODEL:-out/llama8b/rm}
PROMPTS=${PROMPTS:-HuggingFaceH4/ultrachat_200k}   # column: prompt (text)
PROMPT_SPLIT=${PROMPT_SPLIT:-train_gen}
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/ppo}

python ppo_ray.py \
    --pretrain "$SFT_MODEL" \
    --reward_pretrain "$RM_MODEL" \
    --prompt_data "$PROMPTS" --prompt_split "$PROMPT_SPLIT" --input_key prompt \
    --input_template "$INPUT_TEMPLATE" \
    --prompt_max_len 1024 --generate_max_len 1024 \
    --actor_num_workers 4 --ref_num_workers 4 --colocate_actor_ref \
    --critic_num_workers 2 --reward_num_workers 2 --colocate_critic_reward \
    --vllm_num_engines 2 --vllm_tensor_parallel_size 1 \
    --zero_stage 3 --offload_optimizer --gradient_checkpointing \
    --advantage_estimator gae --gamma 1.0 --lambd 0.95 \
    --rollout_batch_size 512 --n_samples_per_prompt 1 \
    --train_batch_size 128 --micro_train_batch_size 4 --micro_rollout_batch_size 8 \
    --max_epochs 1 --max_steps 200 \
    --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
    --init_kl_coef 0.01 --kl_estimator k1 \
    --normalize_reward --reward_clip 10 \
    --save_steps 20 --keep_last_checkpoints 2 \
    --use_wandb --wandb_project llama8b-ppo \
    --output_dir "$OUT" \
    "$@"
