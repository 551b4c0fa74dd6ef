"""Build a tiny Llama-architecture causal LM and a byte-level BPE tokenizer in code, offline and deterministic.

Tests, the demo and the benchmarks never download a model. This module trains a tokenizer on the synthetic task's
text (common/synthetic_task.py) in milliseconds and initialises a small Llama model from a seed, then saves both
with save_pretrained, so every script loads it exactly as it would load a model from the hub.

    python -m common.tiny_model --out /tmp/tiny            # ~1M parameters, a few seconds
    python -m common.tiny_model --out /tmp/100m --hidden_size 768 --num_layers 12   # for benchmarks
"""

import argparse
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common import synthetic_task

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]

# Each message is "<|role|>\n" + content + eos; the generation prompt opens an assistant turn. Every rendered prefix
# of a conversation is a token prefix of the whole, which the multi-turn loss mask in common/data.py relies on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the synthetic task's text; digits are always single tokens."""
    tok = Tokenizer(models.BPE())
    # Single-digit tokens keep arithmetic learnable: "37" is always "3","7", never a merged "37".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_task.tokenizer_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, seed=0) -> LlamaForCausalLM:
    """A randomly initialised Llama. head_dim = hidden_size / num_heads must be >= 32 (vLLM's CPU attention)."""
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(f"hidden_size / num_heads must be a whole number >= 32, got {hidden_size}/{num_heads}.")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def write_tiny_model(out: str, seed: int = 0, **model_kwargs) -> str:
    """Write model + tokenizer to `out` (a Hugging Face model directory) and return the path."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    os.makedirs(out, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    parser.add_argument("--hidden_size", type=int, default=128, help="model width")
    parser.add_argument("--num_layers", type=int, default=4, help="number of transformer blocks")
    parser.add_argument("--num_heads", type=int, default=4, help="attention heads (head_dim = hidden / heads >= 32)")
    parser.add_argument("--num_kv_heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    args = parser.parse_args()
    write_tiny_model(args.out, args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_heads=args.num_heads, num_kv_heads=args.num_kv_heads)
    n = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(args.out).parameters())
    print(f"wrote a {n / 1e6:.2f}M-parameter model and its tokenizer to {args.out}")


if __name__ == "__main__":
    main()
