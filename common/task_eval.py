"""Score a saved model on the synthetic task: greedy accuracy on held-out prompts, with plain transformers.

Used by the tests and the demo to show that a stage improved the model; any script's output folder works.

    python -m common.task_eval --model out/sft --prompts task/prompts_eval.jsonl
"""

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from common.data import as_messages, chat_text, generation_stop_ids, load_records, merged_eos_ids, render_prompt
from common.synthetic_task import extract_answer, reward_fn
from common.vlm import dataset_folder, is_vision_language


@torch.no_grad()
def greedy_responses(model_dir: str, prompts: list, apply_chat_template: bool = True, max_new_tokens: int = 8,
                     batch_size: int = 64) -> list[str]:
    """Greedy completions of `prompts` (left-padded batches), decoded without special tokens.

    Plain greedy decoding, whatever the model's generation_config asks for besides (a repetition penalty, as
    Qwen2.5-Instruct's, would change the answers), stopping where vLLM's engines stop: at the model's EOS tokens
    and the chat template's end-of-turn token."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = merged_eos_ids(model.generation_config.eos_token_id, tokenizer,
                           [tokenizer.eos_token_id] + generation_stop_ids(tokenizer, apply_chat_template))
    greedy = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=stops)
    model.generation_config = GenerationConfig()  # generate fills what `greedy` leaves unset from the model's own
    texts = [render_prompt(tokenizer, p, apply_chat_template, None) for p in prompts]
    responses = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, generation_config=greedy)
        responses += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return responses


@torch.no_grad()
def greedy_image_responses(model_dir: str, prompts: list, base_dir: str, max_new_tokens: int = 8,
                           batch_size: int = 32) -> list[str]:
    """greedy_responses for a vision-language model: chat prompts whose image parts (paths relative to `base_dir`)
    go through the model's processor, as vLLM and the trainers read them."""
    from transformers import AutoModelForImageTextToText

    from common.vlm import load_processor, split_images

    processor = load_processor(model_dir)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=[tokenizer.eos_token_id] + generation_stop_ids(tokenizer, True))
    model.generation_config = GenerationConfig()
    responses = []
    for i in range(0, len(prompts), batch_size):
        split = [split_images(as_messages(p), base_dir) for p in prompts[i: i + batch_size]]
        texts = [chat_text(tokenizer, messages, add_generation_prompt=True) for messages, _ in split]
        enc = processor(text=texts, images=[images for _, images in split], return_tensors="pt", padding=True,
                        add_special_tokens=False)
        out = model.generate(**enc, generation_config=greedy)
        responses += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return responses


def vllm_samples(model_dir: str, prompts: list, n: int = 1, temperature: float = 0.0, max_tokens: int = 8,
                 seed: int = 0) -> list[list[str]]:
    """`n` completions of each chat prompt from one vLLM engine in this process, in fp32 (so that greedy ones can be
    compared token for token with greedy_responses), decoded without special tokens."""
    from vllm import LLM, SamplingParams

    from common.vllm_engine import DEFAULT_CPU_KVCACHE_GIB

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)  # CPU only; a GPU sizes its own
    llm = LLM(model=model_dir, dtype="float32", seed=seed, max_model_len=512, enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, skip_special_tokens=True,
                            stop_token_ids=generation_stop_ids(tokenizer, True))
    texts = [render_prompt(tokenizer, p, True, None) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": tokenizer(t, add_special_tokens=False)["input_ids"]} for t in texts],
                           params, use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outputs]


def vllm_greedy_responses(model_dir: str, prompts: list, max_new_tokens: int = 8) -> list[str]:
    """The same as greedy_responses, generated by a vLLM engine."""
    return [samples[0] for samples in vllm_samples(model_dir, prompts, max_tokens=max_new_tokens)]


def task_scores(model_dir: str, prompts_file: str, limit: int | None = None, engine: str = "hf") -> dict:
    """Greedy decoding on a {"prompt", "label"} file: the fraction answered exactly right ("accuracy") and the
    fraction answered with a number at all ("answered"; the rest are refusals or malformed)."""
    rows = load_records(prompts_file)[:limit]
    if is_vision_language(model_dir):  # the prompts' images are read from beside the file
        responses = greedy_image_responses(model_dir, [r["prompt"] for r in rows], dataset_folder(prompts_file))
    else:
        generate = vllm_greedy_responses if engine == "vllm" else greedy_responses
        responses = generate(model_dir, [r["prompt"] for r in rows])
    scores = reward_fn([r["prompt"] for r in rows], responses, [r["label"] for r in rows])
    return {"accuracy": sum(scores) / len(rows),
            "answered": sum(extract_answer(r) is not None for r in responses) / len(rows)}


def task_accuracy(model_dir: str, prompts_file: str, limit: int | None = None, engine: str = "hf") -> float:
    """Fraction of prompts in a {"prompt", "label"} file answered exactly right by greedy decoding."""
    return task_scores(model_dir, prompts_file, limit, engine)["accuracy"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a saved model folder")
    parser.add_argument("--prompts", required=True, help="a {prompt, label} JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N prompts")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="generate with transformers or vLLM")
    parser.add_argument("--show_responses", action="store_true", help="also print every response")
    args = parser.parse_args()
    if args.show_responses:
        generate = vllm_greedy_responses if args.engine == "vllm" else greedy_responses
        rows = load_records(args.prompts)[: args.limit]
        print(json.dumps({"responses": generate(args.model, [r["prompt"] for r in rows])}))
        return
    accuracy = task_accuracy(args.model, args.prompts, args.limit, args.engine)
    print(json.dumps({"model": args.model, "accuracy": accuracy}))


if __name__ == "__main__":
    main()
