"""common/modeling.next_token_logprobs from a start column, as sft.py, dpo.py and kto.py call it with their loss
mask's response_start: the LM head runs on the positions from there only, and the log-probs equal the full logits'
there, 0 before, on a padded batch and on a packed row. And load_model on a family without sdpa attention."""

import torch
from transformers import AutoModelForCausalLM

from common.data import pack_collate, pad_collate
from common.modeling import next_token_logprobs, response_start

SAMPLES = [([5, 6, 7, 8, 9], [10, 11, 12]), ([13, 14, 15, 16], [17, 18, 19, 20, 21]), ([22, 23, 24, 25, 26, 27], [28])]


def samples() -> list[dict]:
    """SFT samples: prompt tokens out of the loss, response tokens in it."""
    return [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)} for p, r in SAMPLES]


def test_response_start_is_the_first_column_any_row_trains():
    mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    assert response_start(mask) == 2
    assert response_start(torch.zeros(2, 4)) == 0


def test_next_token_logprobs_from_the_response_start_equal_the_full_ones(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    head_positions = []
    model.lm_head.register_forward_hook(lambda _, inputs, __: head_positions.append(inputs[0].shape[1]))
    # padded: the shortest prompt has 4 tokens, entry 3 predicts its first response token; packed: the first has 5
    for batch, first_trained in ((pad_collate(samples(), pad_id=0), 3), (pack_collate(samples()), 4)):
        args = batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
        start = response_start(batch["loss_mask"][:, 1:])
        assert start == first_trained
        with torch.no_grad():
            full = next_token_logprobs(model, *args)
            head_positions.clear()
            skipped = next_token_logprobs(model, *args, start=start)
        assert head_positions == [batch["input_ids"].shape[1] - start]
        assert skipped.shape == full.shape
        torch.testing.assert_close(skipped[:, start:], full[:, start:], rtol=0, atol=1e-5)
        assert (skipped[:, :start] == 0).all()
        trained = batch["loss_mask"][:, 1:].bool()
        torch.testing.assert_close(skipped[trained], full[trained], rtol=0, atol=1e-5)


def test_a_model_without_sdpa_attention_loads_with_eager(tmp_path):
    """GPT-J (and others) refuse attn_implementation="sdpa" with a ValueError: load_model asked for it whatever the
    model, so such a family could not be trained at all; it now takes the fastest implementation the model has."""
    from transformers import GPTJConfig, GPTJForCausalLM

    from common.deepspeed_utils import ds_config, load_model

    GPTJForCausalLM(GPTJConfig(n_embd=64, n_layer=1, n_head=2, vocab_size=64, n_positions=32, rotary_dim=16)
                    ).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), ds_config(0, 1, 1, 1))
    assert type(model).__name__ == "GPTJForCausalLM" and model.config._attn_implementation == "eager"
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)
