"""Build a tiny vision-language model (Idefics3: a SigLIP vision tower, a pixel-shuffle connector, a Llama) and its
processor in code, offline and deterministic, for the tests of the image paths.

As common/tiny_model.py does for text, this writes a folder that every script, transformers'
AutoModelForImageTextToText and AutoProcessor, and a vLLM engine load as they would a model from the hub. The tokenizer
is the tiny text model's, with Idefics3's image tokens added; a 56x56 image becomes 16 patches of 14 pixels, which the
connector merges 2x2 into 4 image tokens.

Why Idefics3 (SmolVLM's architecture) and not Qwen2.5-VL: without torchvision, which this CPU stack leaves out (its
PyPI builds are CUDA builds and break `import transformers`), transformers 5.19 cannot build a Qwen2-VL, Qwen2.5-VL or
Qwen3-VL processor (each needs a video processor), and vLLM 0.32 cannot import its Qwen-VL, Gemma 3 or LLaVA models;
Idefics3's processor and vLLM model need neither. On a GPU machine with the `vllm` package the Qwen-VL families load.

    python -m common.tiny_vlm --out /tmp/tiny_vlm
"""

import argparse
import os

import torch
from transformers import (AutoModelForImageTextToText, Idefics3Config, Idefics3ForConditionalGeneration,
                          Idefics3Processor, LlamaConfig)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.utils import logging as transformers_logging

from common.tiny_model import SPECIAL_TOKENS, build_tokenizer

IMAGE_SIZE = 56  # pixels on a side: every image is resized to fit, then padded, to this square
PATCH_SIZE = 14
SCALE_FACTOR = 2  # the connector's pixel shuffle merges SCALE_FACTOR x SCALE_FACTOR patches into one token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2  # per image, between its two marker tokens

# The tokens Idefics3's processor writes around and into an image; <global-img> is the whole image's tag.
IMAGE_SPECIAL_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]

# The tiny text model's template (common/tiny_model.py) with a message's content either text or a list of parts, as
# processors take them: {"type": "text", "text": ...} and {"type": "image"}, which the processor expands.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_processor(tiles: bool = False) -> Idefics3Processor:
    """The tiny text model's tokenizer with the image tokens, and an image processor that keeps each image whole at
    IMAGE_SIZE or, with `tiles` (the real Idefics3 and SmolVLM checkpoints' default), resizes it to twice that on its
    longer side and cuts it into IMAGE_SIZE tiles, each written between row and column markers, plus the whole image
    at IMAGE_SIZE: a square image is 5 images to the vision tower, a 2:1 one 3."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:] + IMAGE_SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE * (1 + tiles)},
                                                max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=tiles)
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS,
                             chat_template=CHAT_TEMPLATE)


def build_model(processor, hidden_size=128, num_layers=2, num_heads=2, vision_hidden_size=64, vision_layers=2,
                seed=0) -> Idefics3ForConditionalGeneration:
    """A randomly initialised Idefics3; head_dim 64 in the language model and 32 in the vision tower (vLLM's CPU
    attention takes no less than 32)."""
    tokenizer = processor.tokenizer
    text_config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
                              num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
                              max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision_config = dict(hidden_size=vision_hidden_size, intermediate_size=vision_hidden_size * 2,
                         num_hidden_layers=vision_layers, num_attention_heads=vision_hidden_size // 32,
                         image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Idefics3Config(text_config=text_config, vision_config=vision_config, scale_factor=SCALE_FACTOR,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config).float()


def write_tiny_vlm(out: str, seed: int = 0, tiles: bool = False, **model_kwargs) -> str:
    """Write model + processor (tokenizer, image processor, chat template) to `out` and return the path."""
    processor = build_processor(tiles)
    model = build_model(processor, seed=seed, **model_kwargs)
    os.makedirs(out, exist_ok=True)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the model and processor to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    write_tiny_vlm(args.out, args.seed)
    n = sum(p.numel() for p in AutoModelForImageTextToText.from_pretrained(args.out).parameters())
    print(f"wrote a {n / 1e6:.2f}M-parameter vision-language model and its processor to {args.out}")


if __name__ == "__main__":
    main()
