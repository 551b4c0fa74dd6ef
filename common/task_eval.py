"""Score a saved model on the synthetic task: greedy accuracy on held-out prompts, with plain transformers.

Used by the tests and the demo to show that a stage improved the model; any script's output folder works.

    python -m common.task_eval --model out/sft --prompts task/prompts_eval.jsonl
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import load_records, render_prompt
from common.synthetic_task import reward_fn


@torch.no_grad()
def greedy_responses(model_dir: str, prompts: list, apply_chat_template: bool = True, max_new_tokens: int = 8,
                     batch_size: int = 64) -> list[str]:
    """Greedy completions of `prompts` (left-padded batches), decoded without special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [render_prompt(tokenizer, p, apply_chat_template, None) for p in prompts]
    responses = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
        responses += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return responses


def task_accuracy(model_dir: str, prompts_file: str, limit: int | None = None) -> float:
    """Fraction of prompts in a {"prompt", "label"} file answered exactly right by greedy decoding."""
    rows = load_records(prompts_file)[:limit]
    responses = greedy_responses(model_dir, [r["prompt"] for r in rows])
    scores = reward_fn([r["prompt"] for r in rows], responses, [r["label"] for r in rows])
    return sum(scores) / len(scores)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a saved model folder")
    parser.add_argument("--prompts", required=True, help="a {prompt, label} JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    args = parser.parse_args()
    print(json.dumps({"model": args.model, "accuracy": task_accuracy(args.model, args.prompts, args.limit)}))


if __name__ == "__main__":
    main()
