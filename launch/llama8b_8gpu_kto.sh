#!/usr/bin/env bash
# KTO of an 8B Llama-architecture model: the SFT model from llama8b_8gpu_sft.sh learns from responses labelled
# desirable or undesirable, one at a time (no pairs needed), against a frozen copy of itself.
#
# Hardware  1 node, 8 GPUs of 80 GB (A100 or H100), 256 GB of CPU memory.
# Time      about 30 min on A100s for one epoch of the 25.7k labelled responses below; an estimate from the model's
#           FLOPs, not a measurement.
# Set       SFT_MODEL, DATASET (a .jsonl of {"prompt", "response", "label": true|false}), OUT; WANDB_API_KEY.
# Run       bash launch/llama8b_8gpu_kto.sh [more flags]     (extra flags win; rerunning resumes)
#
# Without a DATASET file, one is made from the preference pairs the DPO stage uses: every chosen response becomes a
# desirable example and every rejected one an undesirable example. Real feedback (thumbs up/down) needs no pairing.
# Each micro-batch must hold 2 or more samples: KTO pairs every prompt with another sample's response to estimate
# its KL reference point. With skewed data, set --desirable_weight / --undesirable_weight as the start-up line advises.
set -euo pipefail
cd "$(dirname "$0")/.."

SFT_MODEL=${SFT_MODEL:-out/llama8b/sft}
DATASET=${DATASET:-out/llama8b/data/kto_orca.jsonl}
INPUT_TEMPLATE=${INPUT_TEMPLATE:-$'User: {}\nAssistant: '}   # the SFT stage's; a chat model: --apply_chat_template
OUT=${OUT:-out/llama8b/kto}

if [ ! -f "$DATASET" ]; then
    mkdir -p "$(dirname "$DATASET")"
    python - "$DATASET" <<'EOF'
import json, sys
import datasets
with open(sys.argv[1], "w") as f:
    for row in datasets.load_dataset("Intel/orca_dpo_pairs", split="train"):
        f.write(json.dumps({"prompt": row["question"], "response": row["chosen"], "label": True}) + "\n")
        f.write(json.dumps({"prompt": row["question"], "response": row["rejected"], "label": False}) + "\n")
EOF
fi

deepspeed --num_gpus 8 kto.py \
    --pretrain "$SFT_MODEL" \
    --dataset "$DATASET" \
    --input_key prompt --output_key response --label_key label \
    --input_template "$INPUT_TEMPLATE" \
    --max_len 2048 \
    --zero_stage 3 --gradient_checkpointing \
    --train_batch_size 128 --micro_train_batch_size 4 \
    --max_epochs 1 --learning_rate 5e-7 --warmup_ratio 0.03 \
    --beta 0.1 --desirable_weight 1.0 --undesirable_weight 1.0 \
    --logging_steps 1 --save_steps 50 \
    --use_wandb --wandb_project llama8b-kto \
    --output_dir "$OUT" \
    "$@"
