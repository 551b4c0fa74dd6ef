"""Dropout is off in every model the preference and RL scripts load (common.deepspeed_utils.disable_dropout), in
whichever form its family keeps it; SFT keeps what the config asks for, and a saved config is never changed.

With dropout on, PPO's update and vLLM disagreed on the log-probs of the very tokens vLLM had sampled (0.06 on
average on GPT-2 and OPT models, against 1e-7 on Llama-like ones), and every ratio, KL and implicit reward was noise.
The fixtures below set each family's dropout fields to 0.1: GPT-2 holds nn.Dropout modules, Llama and OPT hand a float
to the attention kernel or a functional dropout, GPT-NeoX and Phi-3 do both; OPT's LayerDrop skips whole layers.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.deepspeed_utils import ds_config, load_model

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}
FAMILIES = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
             "attn_pdrop": 0.1},
    "opt": {**SIZES, "ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": 0.1, "attention_dropout": 0.1,
            "activation_dropout": 0.1, "layerdrop": 0.5},  # LayerDrop skips whole layers at random
    "gpt_neox": {**SIZES, "intermediate_size": 128, "attention_dropout": 0.1, "hidden_dropout": 0.1},
    "llama": {**SIZES, "intermediate_size": 128, "num_key_value_heads": 1, "attention_dropout": 0.1},
    "phi3": {**SIZES, "intermediate_size": 128, "num_key_value_heads": 1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
             "attention_dropout": 0.1},
}
CONFIG = ds_config(stage=0, train_batch_size=1, micro_batch_size=1, world_size=1)


def write(family: str, folder) -> str:
    config = AutoConfig.for_model(family, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def forward(model, ids: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loaded_model_computes_in_train_mode_as_in_eval_mode_and_keeps_its_config(family, tmp_path):
    path = write(family, tmp_path)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    kept = load_model(path, CONFIG, dropout=True).train()  # as sft.py loads it
    assert not torch.equal(forward(kept, ids, 0), forward(kept, ids, 1)), "the fixture has no dropout to turn off"

    model = load_model(path, CONFIG)  # as every other script loads it
    model.train()
    trained = [forward(model, ids, seed) for seed in (0, 1)]
    model.eval()
    assert torch.equal(trained[0], trained[1]) and torch.equal(trained[0], forward(model, ids, 0))
    for field, value in FAMILIES[family].items():  # what save_pretrained writes is the user's config
        assert getattr(model.config, field) == value, field
