"""Build a tiny causal LM (Llama, Qwen2 or Mixtral) and a byte-level BPE tokenizer in code, offline and deterministic.

Tests, the demo and the benchmarks never download a model. This module trains a tokenizer on the synthetic task's
text (common/synthetic_task.py) in milliseconds and initialises a small model from a seed, then saves both
with save_pretrained, so every script loads it exactly as it would load a model from the hub.

The default is an untied Llama with grouped-query attention and the project's own chat template. The options vary
what real small models vary, so that code which only works on the default cannot hide: tied input/output
embeddings (Qwen2.5-0.5B, Llama-3.2-1B, Gemma), attention biases (Qwen2 always has q/k/v biases), a mixture of
experts (Mixtral: 4 experts, 2 per token, kept fused by transformers 5), and a ChatML template that writes a newline
after the end-of-turn token, as Qwen's does.

    python -m common.tiny_model --out /tmp/tiny            # ~1M parameters, a few seconds
    python -m common.tiny_model --out /tmp/qwen --architecture qwen2 --tie_word_embeddings --chat_format chatml
    python -m common.tiny_model --out /tmp/100m --hidden_size 768 --num_layers 12   # for benchmarks
"""

import argparse
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)
from transformers.utils import logging as transformers_logging

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

# ChatML as Qwen writes it: the end-of-turn token <|im_end|> is the EOS, and a newline follows it, so a rendered
# conversation does not end with EOS. No BOS token.
CHATML_SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 384, chat_format: str = "default") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the synthetic task's text; digits are always single tokens.

    chat_format "default" renders "<|role|>\n" + content + EOS per message; "chatml" renders Qwen's ChatML.
    """
    if chat_format not in ("default", "chatml"):
        raise ValueError(f"chat_format must be 'default' or 'chatml', got {chat_format!r}.")
    chatml = chat_format == "chatml"
    special_tokens = CHATML_SPECIAL_TOKENS if chatml else SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    # Single-digit tokens keep arithmetic learnable: "37" is always "3","7", never a merged "37".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_task.tokenizer_corpus(), trainer=trainer)
    if chatml:
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                       additional_special_tokens=CHATML_SPECIAL_TOKENS[1:3],
                                       chat_template=CHATML_TEMPLATE, model_max_length=2048)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "mixtral": (MixtralConfig, MixtralForCausalLM)}


def build_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, seed=0,
                architecture="llama", tie_word_embeddings=False, attention_bias=False, pad_vocab_to_multiple_of=1):
    """A randomly initialised Llama, Qwen2 or Mixtral. head_dim = hidden_size / num_heads must be >= 32 (vLLM's CPU
    attention).

    pad_vocab_to_multiple_of rounds the embedding's rows up, as released models do (Qwen2.5: 151,936 rows for
    151,665 tokens); at 64, vLLM's own padding adds none, and its engine handles the embedding as it does theirs.

    attention_bias gives a Llama biases on q/k/v/o; a Qwen2 always has q/k/v biases (and none on o); a Mixtral has 4
    experts of intermediate_size each, 2 per token, and no biases.
    """
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(f"hidden_size / num_heads must be a whole number >= 32, got {hidden_size}/{num_heads}.")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {architecture!r}.")
    if architecture != "llama" and attention_bias:
        raise ValueError("attention_bias is for the Llama architecture (a Qwen2 always has q/k/v biases).")
    config_class, model_class = ARCHITECTURES[architecture]
    extra = {"llama": {"attention_bias": attention_bias}, "qwen2": {},
             "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}}[architecture]
    config = config_class(
        vocab_size=-(-len(tokenizer) // pad_vocab_to_multiple_of) * pad_vocab_to_multiple_of,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    return model_class(config).float()


def write_tiny_model(out: str, seed: int = 0, chat_format: str = "default", **model_kwargs) -> str:
    """Write model + tokenizer to `out` (a Hugging Face model directory) and return the path.

    model_kwargs go to build_model (sizes, architecture, tie_word_embeddings, attention_bias, pad_vocab_to_multiple_of).
    """
    tokenizer = build_tokenizer(chat_format=chat_format)
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
    parser.add_argument("--architecture", choices=list(ARCHITECTURES), default="llama",
                        help="llama, qwen2 (q/k/v biases) or mixtral (4 experts, 2 per token)")
    parser.add_argument("--tie_word_embeddings", action="store_true",
                        help="share one matrix between the input embeddings and the output layer")
    parser.add_argument("--attention_bias", action="store_true", help="biases on a Llama's q/k/v/o projections")
    parser.add_argument("--chat_format", choices=["default", "chatml"], default="default",
                        help="chat template: the project's own, or ChatML (a newline after the EOS <|im_end|>)")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()  # one line of output, in a terminal or a log file
    write_tiny_model(args.out, args.seed, args.chat_format, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, architecture=args.architecture,
                     tie_word_embeddings=args.tie_word_embeddings, attention_bias=args.attention_bias)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(args.out).parameters())
    print(f"wrote a {n / 1e6:.2f}M-parameter model and its tokenizer to {args.out}")


if __name__ == "__main__":
    main()
