#!/usr/bin/env bash
# GRPO of an 8B vision-language model (Idefics3-8B-Llama3: a SigLIP vision tower, a pixel-shuffle connector, a
# Llama-3-8B) on image prompts scored by a rule: visual question answering with a checkable answer (counting, chart
# and geometry questions). Start from the model, or better from an SFT of it on the task (sft.py takes the same rows
# with a "response").
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      roughly 1-2 min per step of 512 responses of up to 512 tokens after prompts of one image (up to 17 tiles
#           of 169 tokens), so 2-4 h for the 100 steps below; an estimate from the FLOPs and vLLM's usual
#           throughput, not a measurement.
# Set       MODEL, PROMPTS (a .jsonl of {"prompt": [chat messages with {"type": "image", "image": path}], "label"}),
#           REWARD_FN ('file.py:function', called with the prompts, responses and labels), OUT; WANDB_API_KEY.
# Run       bash launch/idefics3_8b_8gpu_grpo.sh [more flags]     (extra flags win; rerunning resumes)
#
# Layout (8 GPUs, docs/vlm.md):
#   4 GPUs  actor, 4 ZeRO-3 ranks, the reference colocated on the same GPUs
#   4 GPUs  4 vLLM engines, one GPU each, given each prompt's images as multi_modal_data
# The vision tower stays frozen (--freeze_vision_tower, the default): no gradients or Adam states for its 0.4B
# parameters, and the weight sync sends the language model and the connector alone. --freeze_vision_tower false
# trains and syncs it too. GRPO needs no critic, and a reward model would read the text alone: the reward is a rule.
# An image's tokens count toward --prompt_max_len, as they fill vLLM's context: Idefics3 cuts an image into tiles of
# 364 pixels (16 at its largest size, plus the whole image), 169 tokens each. The plan (--dry_run): ~66 GiB on each
# actor GPU, the fp32 logits of 2 x 3584 tokens over 128k words the largest share after the model states.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-HuggingFaceM4/Idefics3-8B-Llama3}
PROMPTS=${PROMPTS:-data/vqa_prompts.jsonl}
REWARD_FN=${REWARD_FN:-common/synthetic_task.py:reward_fn}   # 1 when the response's first number is the label
OUT=${OUT:-out/idefics3_8b/grpo}

python ppo_ray.py \
    --pretrain "$MODEL" \
    --prompt_data "$PROMPTS" --input_key prompt --label_key label --apply_chat_template \
    --reward_fn "$REWARD_FN" \
    --prompt_max_len 3072 --generate_max_len 512 \
    --actor_num_workers 4 --ref_num_workers 4 --colocate_actor_ref \
    --vllm_num_engines 4 --vllm_tensor_parallel_size 1 \
    --zero_stage 3 --gradient_checkpointing \
    --advantage_estimator grpo --n_samples_per_prompt 8 \
    --rollout_batch_size 64 --train_batch_size 128 --micro_train_batch_size 2 --micro_rollout_batch_size 2 \
    --max_epochs 1 --max_steps 100 \
    --actor_learning_rate 1e-6 --init_kl_coef 0.001 \
    --save_steps 10 --keep_last_checkpoints 2 \
    --use_wandb --wandb_project idefics3-8b-grpo \
    --output_dir "$OUT" \
    "$@"
