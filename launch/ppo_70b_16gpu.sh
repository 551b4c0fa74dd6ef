#!/usr/bin/env bash
# PPO of a 70B Llama-architecture model on 16 GPUs, in the layout of the OpenRLHF paper (arXiv 2405.11143): every
# model on GPUs of its own, placed by Ray over two nodes.
#
# Hardware  2 nodes x 8 GPUs of 80 GB (A100 or H100) joined in a Ray cluster, 1.6 TB+ of CPU memory per node (the
#           actor's and the critic's Adam states, ~1.5 TiB each by DeepSpeed's estimate, are offloaded to CPU and
#           each sits on one node; `--dry_run` prints the whole memory plan), a shared filesystem holding
#           this checkout, its .venv, the models and $OUT at the same path on both nodes.
# Time      on the order of 30-60 min per PPO step of 1024 rollouts of up to 1024 tokens on A100s, i.e. days for the
#           100 steps below; an estimate from the FLOPs, not a measurement. A checkpoint (actor + critic with their
#           optimizer states) takes ~2 TB: mind --keep_last_checkpoints.
# Set       SFT_MODEL, RM_MODEL (local folders on the shared filesystem: every node loads them), PROMPTS, OUT,
#           RAY_ADDRESS (default "auto": the cluster this node belongs to).
# Run       on a node of a running Ray cluster (launch/ray_cluster_manual.md, or launch/slurm_ppo.sbatch, which starts
#           the cluster and runs this layout itself):   bash launch/ppo_70b_16gpu.sh [more flags]
#
# Layout (16 GPUs):
#   actor     4 GPUs   ZeRO-3, Adam states in CPU memory (--offload_optimizer)
#   critic    4 GPUs   ZeRO-3, initialised from the reward model, Adam states in CPU memory
#   reference 2 GPUs   ZeRO-3, weights in CPU memory (--ref_offload): 140 GB of bf16 weights do not fit on 2 GPUs
#   reward    2 GPUs   as the reference (--ref_offload covers both)
#   vLLM      1 engine x tensor parallel 4 = 4 GPUs, which takes the actor's weights after every step
# The experience phase's forwards run 4 responses at a time (--micro_rollout_batch_size; training runs 1): the
# offloaded reference and reward model stream their weights from CPU memory 128 times per step instead of 512.
# Checkpoints go to $OUT on the shared filesystem: actor rank 0 commits each one for every node.
# vLLM memory: at tensor parallel 4 each vLLM GPU holds ~33 GiB of the 70B weights in its 85% (68 GiB), leaving
# ~31 GiB of KV cache (~49 sequences of 2048 tokens at once). At tensor parallel 2 the weights (~66 GiB) would leave
# none, and `--dry_run` refuses that plan; with 141 GB GPUs (H200) two engines of tensor parallel 2 fit.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-/shared/models/llama70b-sft}
RM_MODEL=${RM_MODEL:-/shared/models/llama70b-rm}
PROMPTS=${PROMPTS:-HuggingFaceH4/ultrachat_200k}   # column: prompt (text)
PROMPT_SPLIT=${PROMPT_SPLIT:-train_gen}
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-/shared/out/llama70b/ppo}
RAY_ADDRESS=${RAY_ADDRESS:-auto}

python ppo_ray.py \
    --ray_address "$RAY_ADDRESS" \
    --pretrain "$SFT_MODEL" \
    --reward_pretrain "$RM_MODEL" \
    --prompt_data "$PROMPTS" --prompt_split "$PROMPT_SPLIT" --input_key prompt \
    --input_template "$INPUT_TEMPLATE" \
    --prompt_max_len 1024 --generate_max_len 1024 \
    --actor_num_workers 4 --critic_num_workers 4 --ref_num_workers 2 --reward_num_workers 2 \
    --vllm_num_engines 1 --vllm_tensor_parallel_size 4 \
    --zero_stage 3 --offload_optimizer --ref_offload --gradient_checkpointing \
    --advantage_estimator gae \
    --rollout_batch_size 1024 --n_samples_per_prompt 1 \
    --train_batch_size 128 --micro_train_batch_size 1 --micro_rollout_batch_size 4 \
    --max_epochs 1 --max_steps 100 \
    --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \
    --init_kl_coef 0.01 \
    --save_steps 10 --keep_last_checkpoints 1 \
    --use_wandb --wandb_project llama70b-ppo \
    --output_dir "$OUT" \
    "$@"
