"""The tiny fixture model: its default stays what learning results were measured on, and its options give the
variants real small models come in (tied embeddings, attention biases, ChatML)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.tiny_model import write_tiny_model


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def test_default_is_an_untied_llama_with_grouped_query_attention(tiny_model):
    model, tokenizer = load(tiny_model)
    config = model.config
    assert (config.model_type, config.tie_word_embeddings, config.attention_bias) == ("llama", False, False)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == (128, 4, 4, 2)
    names = dict(model.named_parameters())
    assert "lm_head.weight" in names and not any(name.endswith("bias") for name in names)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).endswith("<eos>")


@pytest.mark.parametrize("architecture, attention_bias, biased", [("qwen2", False, ("q_proj", "k_proj", "v_proj")),
                                                                  ("llama", True, ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"))])
def test_tied_variants_share_one_matrix_and_carry_biases(tmp_path, architecture, attention_bias, biased):
    path = write_tiny_model(str(tmp_path), seed=0, chat_format="chatml", architecture=architecture,
                            tie_word_embeddings=True, attention_bias=attention_bias)
    model, tokenizer = load(path)
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names  # a tied model names the matrix once, as the checkpoints on the hub do
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {name.split(".")[-2] for name in names if name.endswith("bias")} == set(biased)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n" and tokenizer.eos_token == "<|im_end|>"


def test_the_mixtral_variant_keeps_four_fused_experts_per_layer(tmp_path):
    """make gpu-smoke's MoE stage starts from it: 4 experts of 3 x hidden each, 2 per token, as transformers 5 keeps
    them (fused tensors, no nn.Linear per expert), and no biases."""
    model, _ = load(write_tiny_model(str(tmp_path), seed=0, architecture="mixtral"))
    config = model.config
    assert (config.model_type, config.num_local_experts, config.num_experts_per_tok) == ("mixtral", 4, 2)
    experts = model.model.layers[0].mlp.experts
    assert sum(p.numel() for p in experts.parameters()) == 4 * 3 * 128 * 384
    assert not any(isinstance(m, torch.nn.Linear) for m in experts.modules())
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
