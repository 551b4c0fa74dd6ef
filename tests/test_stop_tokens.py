"""Where sampling stops: a base model's chat template ends a turn with a token that is neither its EOS nor in its
generation_config (Qwen2.5 base: <|im_end|> against <|endoftext|>; Llama-3 base: <|eot_id|> against
<|end_of_text|>). sft.py trains the policy to end its turn with the template's token; vLLM, which stops only at the
EOS and generation_config's tokens, ran on past it into a made-up next turn, and rejection sampling dropped such
samples as cut at --generate_max_len, or handed SFT the text of the next turn."""

import pytest
from transformers import PreTrainedTokenizerFast

from common import data
from common.tiny_model import build_model, build_tokenizer


def chatml_base_tokenizer():
    """ChatML's template on a tokenizer whose EOS is <|endoftext|>, as a Qwen2.5 base model has it."""
    chatml = build_tokenizer(chat_format="chatml")
    return PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer, pad_token="<pad>",
                                   eos_token="<|endoftext|>", chat_template=chatml.chat_template)


def test_the_engines_stop_at_the_templates_end_of_turn_token_where_it_is_not_the_eos():
    base, chatml = chatml_base_tokenizer(), build_tokenizer(chat_format="chatml")
    end_id = base.convert_tokens_to_ids("<|im_end|>")
    assert data.generation_stop_ids(base, True) == [end_id]
    assert data.generation_stop_ids(base, False) == []  # no template, no turns
    assert data.generation_stop_ids(chatml, True) == []  # its EOS is <|im_end|>: vLLM stops there anyway
    prompt = base("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    seven = base("7", add_special_tokens=False)["input_ids"]
    assert data.decode_response(base, prompt, seven + [end_id]) == "7"


def test_a_saved_model_stops_at_the_end_of_turn_token_it_was_trained_to_end_its_turns_with(tmp_path):
    """A base model fine-tuned on ChatML: its saved generation_config named only <|endoftext|>, so transformers'
    generate and a vLLM server outside this library ran past <|im_end|>."""
    from transformers import GenerationConfig

    from common.checkpoint import save_hf_model

    tokenizer = chatml_base_tokenizer()
    model = build_model(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_hf_model(model, tokenizer, str(tmp_path), rank=0, stop_ids=data.generation_stop_ids(tokenizer, True))
    saved = GenerationConfig.from_pretrained(tmp_path).eos_token_id
    assert saved == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.slow
def test_a_vllm_engine_ends_a_sample_at_its_stop_tokens_and_keeps_the_token(tmp_path):
    """The engine (as create_vllm_engines makes it with stop_at_end_of_turn, in this process), pushed towards
    <|im_end|> by a logit bias."""
    from common.vllm_engine import VLLMEngine

    tokenizer = chatml_base_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer(data.render_prompt(tokenizer, "What is 3+4?", True, None), add_special_tokens=False)
    engine = VLLMEngine(str(tmp_path), 0, 64, 1, 0.5, True, None, False, False, None, {}, True)
    assert engine.stop_token_ids == [end_id]
    try:
        [samples] = engine.generate([prompt["input_ids"]], n=2, max_tokens=6, logprobs=False,
                                    logit_bias={end_id: 100.0})
        assert [(s["finish_reason"], s["token_ids"]) for s in samples] == [("stop", [end_id])] * 2
        [samples] = engine.generate([prompt["input_ids"]], n=1, max_tokens=6, logprobs=False,
                                    logit_bias={end_id: 100.0}, stop_token_ids=[])  # without it: on past the turn
        assert samples[0]["finish_reason"] == "length" and samples[0]["token_ids"][0] == end_id
    finally:
        engine.shutdown()


def test_task_eval_decodes_greedily_whatever_the_models_generation_config_asks_for(tiny_model, tmp_path):
    """transformers fills every field a generation config passed to generate leaves unset from the model's own:
    Qwen2.5-Instruct's repetition_penalty 1.05 changed the answers task_eval scored. Now they are plain greedy."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from common.task_eval import greedy_responses

    penalised = str(tmp_path / "penalised")
    shutil.copytree(tiny_model, penalised)
    GenerationConfig(do_sample=True, temperature=0.7, top_k=20, repetition_penalty=5.0,
                     no_repeat_ngram_size=2).save_pretrained(penalised)
    prompts = ["What is 2+3?", "What is 10+7?", "Add 4 and 4."]
    plain = greedy_responses(tiny_model, prompts, max_new_tokens=12)
    assert greedy_responses(penalised, prompts, max_new_tokens=12) == plain
    model = AutoModelForCausalLM.from_pretrained(penalised)
    tokenizer = AutoTokenizer.from_pretrained(penalised)
    ids = tokenizer(prompts[0], return_tensors="pt").input_ids
    with_config = model.generate(ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=12))
    without = AutoModelForCausalLM.from_pretrained(tiny_model).generate(
        ids, generation_config=GenerationConfig(do_sample=False, max_new_tokens=12))
    assert not torch.equal(with_config, without), "the penalty changes nothing here: no test"
