"""LoRA (common/lora.py): the merged weights are the adapted model's, the reference is the base model, and the LoRA
flags that cannot work are refused in one sentence."""

import copy
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from common import lora
from common.args import UserError
from common.tiny_model import write_tiny_model

VARIANTS = {
    "llama": {},  # untied, grouped-query attention, no biases
    "qwen2 tied": {"architecture": "qwen2", "tie_word_embeddings": True},  # and q/k/v biases
}


def lora_args(**overrides):
    values = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear",
              "load_in_4bit": False, "zero_stage": 3}
    return types.SimpleNamespace(**{**values, **overrides})


@pytest.fixture(scope="module", params=list(VARIANTS))
def model_dir(request, tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("lora_model")), seed=0, **VARIANTS[request.param])


def trained_adapter(model_class, path, task_type, **kwargs):
    """The model with adapters whose B matrices are random, as after training (fresh ones are zero)."""
    torch.manual_seed(0)
    model = lora.wrap(model_class.from_pretrained(path, **kwargs), lora_args(), task_type)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("head", ["causal lm", "scalar head"])
def test_merged_model_computes_what_the_adapted_model_computes(model_dir, head, tmp_path):
    """The state dict the trainers save, loaded into a plain transformers model, gives the adapted model's outputs."""
    model_class = AutoModelForCausalLM if head == "causal lm" else AutoModelForSequenceClassification
    kwargs = {} if head == "causal lm" else {"num_labels": 1}
    task_type = "CAUSAL_LM" if head == "causal lm" else "SEQ_CLS"
    model = trained_adapter(model_class, model_dir, task_type, **kwargs)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)

    merged = lora.merged_state_dict({k: v.clone() for k, v in model.state_dict().items()}, model)
    plain = model_class.from_pretrained(model_dir, **kwargs).eval()
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    ids = torch.randint(3, 300, (3, 17))
    with torch.no_grad():
        adapted, base = model(input_ids=ids).logits, plain(input_ids=ids).logits
        torch.testing.assert_close(base, adapted, atol=1e-5, rtol=1e-5)
        with lora.reference(model):  # adapters off: the model it started from
            reference = model(input_ids=ids).logits
        start = model_class.from_pretrained(model_dir, **kwargs).eval()
        if head == "causal lm":  # a fresh scalar head is random, so only the LM compares
            torch.testing.assert_close(reference, start(input_ids=ids).logits)
    assert (adapted - reference).abs().max() > 1e-3  # the adapters do change the model

    # peft's own merge agrees (a second opinion on the arithmetic, fan-in/fan-out and scaling included)
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, peft_merged[name], atol=1e-6, rtol=1e-6)


def test_the_sync_sends_the_merged_weights_of_the_adapted_layers(model_dir):
    model = trained_adapter(AutoModelForCausalLM, model_dir, "CAUSAL_LM")
    merged = lora.merged_state_dict(dict(model.state_dict()), model)
    sent = dict(lora.iter_merged_params(model))
    linear = [n for n, m in lora.base_model(model).named_modules() if ".layers." in n and n.endswith("_proj")]
    assert sorted(sent) == sorted(f"{n}.weight" for n in linear)  # every linear layer but the output head
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name])


@pytest.mark.parametrize("overrides, words", [
    ({"lora_rank": -1}, "--lora_rank must be 0"),
    ({"lora_alpha": 0}, "--lora_alpha must be positive"),
    ({"lora_dropout": 1.0}, "--lora_dropout must be in [0, 1)"),
    ({"lora_rank": 0, "load_in_4bit": True}, "give --lora_rank too"),
    ({"load_in_4bit": True}, "--load_in_4bit needs a CUDA GPU"),
])
def test_lora_flags_that_cannot_work_are_one_sentence(overrides, words):
    if torch.cuda.is_available() and "CUDA" in words:
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        lora.check_args(lora_args(**overrides))


def test_target_modules_the_model_lacks_are_named_with_the_ones_it_has(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(UserError, match=r"--target_modules c_attn: .* some of this model's linear layers: .*q_proj"):
        lora.wrap(model, lora_args(target_modules="c_attn"))
    assert lora.wrap(model, lora_args(lora_rank=0)) is model


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft's, about the refused head
def test_an_adapter_on_a_head_tied_to_the_embedding_is_refused(model_dir):
    """Merged, the head would differ from the embedding its config still ties it to: transformers unties them on
    load with a warning, vLLM keeps one of the two (and the weight sync overwrote the input embedding with the
    head). An untied head takes an adapter like any linear layer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if model.config.tie_word_embeddings:
        with pytest.raises(UserError, match=r"--target_modules q_proj,lm_head: lm_head shares its weight with the "
                                            r"input embedding .* leave lm_head out\."):
            lora.wrap(model, lora_args(target_modules="q_proj,lm_head"))
    else:
        wrapped = lora.wrap(model, lora_args(target_modules="q_proj,lm_head"))
        assert any(name.endswith("lm_head.lora_A.default.weight") for name, _ in wrapped.named_parameters())


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft's, about the refused embedding
def test_the_weight_sync_sends_each_adapted_layer_merged_with_the_linear_layers_beside_it(model_dir):
    """vLLM fuses q/k/v and gate/up into one weight, rebuilt from what a sync sends: adapters on q_proj and v_proj
    alone left k's rows of qkv_proj uninitialised. An adapter on an embedding is refused: merging and the sync read
    lora_A/lora_B only, and it would have been dropped from both."""
    torch.manual_seed(0)
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(model_dir), lora_args(target_modules="q_proj,gate_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn_like(p))
    merged = lora.merged_state_dict({k: v.clone() for k, v in model.state_dict().items()}, model)
    sent = dict(lora.iter_merged_params(model))
    layers = AutoModelForCausalLM.from_pretrained(model_dir).config.num_hidden_layers
    expected = {f"model.layers.{i}.{block}.{layer}.weight" for i in range(layers) for block, names in
                (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj",
                                                                                  "down_proj"))) for layer in names}
    assert set(sent) == expected
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name])
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)  # merged
    with pytest.raises(UserError, match="--target_modules embed_tokens,q_proj: embed_tokens is not a linear layer"):
        lora.wrap(AutoModelForCausalLM.from_pretrained(model_dir), lora_args(target_modules="embed_tokens,q_proj"))


def test_a_base_model_with_a_quantizer_is_saved_as_the_merged_weights(model_dir, tmp_path):
    """A QLoRA run's base model carries bitsandbytes' quantizer, and transformers' save_pretrained then wrote the
    model's own 4-bit state dict, ignoring the merged one it was given: from_pretrained initialised every adapted
    layer afresh. A stand-in quantizer (bitsandbytes is installed on CUDA machines only) shows the save path."""
    from transformers import AutoTokenizer
    from transformers.quantizers.base import HfQuantizer

    from common.checkpoint import save_hf_model

    class StandIn(HfQuantizer):  # what save_pretrained asks of a quantizer
        def __init__(self):
            pass

        def is_serializable(self):
            return True

        @property
        def is_trainable(self):
            return True

        def _process_model_before_weight_loading(self, *args, **kwargs):
            pass

    model = trained_adapter(AutoModelForCausalLM, model_dir, "CAUSAL_LM")
    base = lora.base_model(model)
    base.hf_quantizer = StandIn()
    base.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    save_hf_model(model, AutoTokenizer.from_pretrained(model_dir), str(tmp_path / "out"), rank=0)
    assert isinstance(base.hf_quantizer, StandIn) and base.config.quantization_config  # the run's model is as it was
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert getattr(saved.config, "quantization_config", None) is None
    ids = torch.randint(3, 300, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_qlora_model_is_saved_dequantized_and_merged(model_dir, tmp_path):
    """QLoRA's save path, run on CPU (bitsandbytes has CPU kernels, though the scripts refuse 4-bit without a GPU,
    where it pays): the 4-bit base weights are dequantized and merged, so the saved full-precision model computes
    what the adapted 4-bit model computes."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is installed on CUDA machines (requirements.txt)")
    from transformers import BitsAndBytesConfig

    from common.deepspeed_utils import gathered_state_dict

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, device_map={"": "cpu"})
    model = lora.wrap(model, lora_args(zero_stage=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn_like(p))
    model.eval()
    # Before any forward: bitsandbytes' CPU backend repacks a 4-bit weight for its own kernel at the first one.
    merged = lora.merged_state_dict(gathered_state_dict(model, rank=0), model)
    for name, tensor in lora.iter_merged_params(model):  # what the weight sync to vLLM sends
        torch.testing.assert_close(tensor, merged[name])
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    q_proj = lora.base_model(model).model.layers[0].self_attn.q_proj.base_layer.weight
    assert q_proj.dtype == torch.uint8 and merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    ids = torch.randint(3, 300, (2, 11))
    with torch.no_grad():
        adapted, saved = model(input_ids=ids).logits, plain(input_ids=ids).logits
        with lora.reference(model):
            base = model(input_ids=ids).logits
    # bitsandbytes' CPU matmul rounds (a dequantized copy of the 4-bit model, without adapters, is as far from it),
    # so the merged model is held to carrying nearly all of the adapters' effect rather than to float rounding.
    assert (saved - adapted).abs().max() < 0.05 * (base - adapted).abs().max()


def test_qlora_first_sync_sends_every_4bit_layer_as_the_trainer_computes_with_it(model_dir):
    """The engines load --pretrain in full precision, while a QLoRA actor computes with its NF4 rounding. The first
    sync sent only the adapted layers and their siblings, so with q_proj,v_proj the MLPs (and o_proj) stayed
    unquantized in vLLM for the whole run; it now sends every 4-bit layer dequantized, later syncs what the adapters
    change. On CPU, as test_a_qlora_model_is_saved_dequantized_and_merged."""
    bitsandbytes = pytest.importorskip("bitsandbytes", reason="bitsandbytes is installed on CUDA machines "
                                                              "(requirements.txt)")
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization, device_map={"": "cpu"})
    model = lora.wrap(model, lora_args(target_modules="q_proj,v_proj", zero_stage=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn_like(p))
    # Before any forward in eval mode without grad: bitsandbytes' CPU backend repacks a 4-bit weight then.
    quantized = {name.removeprefix(lora.PEFT_PREFIX).removesuffix(".base_layer"): m
                 for name, m in model.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)}
    assert any(".mlp." in name for name in quantized) and any(".o_proj" in name for name in quantized)

    first = dict(lora.iter_merged_params(model, everything_quantized=True))
    assert set(first) == {f"{name}.weight" for name in quantized}  # every layer that computes in 4 bits
    for name, layer in quantized.items():
        weight = first[f"{name}.weight"]
        dequantized = bitsandbytes.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        if name.endswith(("q_proj", "v_proj")):  # adapted: W dequantized + (alpha / r) B A
            assert (weight - dequantized).abs().max() > 1e-4
            continue
        assert torch.equal(weight, dequantized)
        x = torch.randn(3, weight.shape[1], requires_grad=True)  # the training path, as the actor's update runs
        torch.testing.assert_close(layer(x).detach(), torch.nn.functional.linear(x.detach(), weight, layer.bias))

    later = dict(lora.iter_merged_params(model))  # after a step: the adapted layers and their siblings
    assert {name.rsplit(".", 2)[-2] for name in later} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for name, tensor in later.items():
        assert torch.equal(tensor, first[name])


@pytest.mark.slow
def test_qlora_vllm_samples_from_the_trainers_weights_after_the_first_sync(tiny_model, monkeypatch):
    """End to end through a vLLM engine on CPU (~35 s): after QLoRA's first sync, vllm/logprob_diff is at float
    rounding. Before it, the engine samples from the full-precision checkpoint; after the old first sync (adapted
    layers and their siblings only), from full-precision MLPs."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is installed on CUDA machines (requirements.txt)")
    if torch.cuda.is_available():
        pytest.skip("the engine would run on the GPU in bf16, off the float32 rounding level this test holds it to")
    import ray
    from transformers import BitsAndBytesConfig

    from common.vllm_engine import create_vllm_engines, shutdown_engines
    from common.weight_sync import broadcast_weights_to_vllm, init_weight_sync_group

    for name, value in {"RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():  # before Ray starts: its actors inherit them
        monkeypatch.setenv(name, value)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, quantization_config=quantization, device_map={"": "cpu"})
    model = lora.wrap(model, lora_args(target_modules="q_proj,v_proj", zero_stage=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn_like(p))
    model.train()  # bitsandbytes' CPU backend would repack the 4-bit weights at an eval forward (GPUs never do)
    prompts = [[5 + i, 40 + 3 * i, 100 + 7 * i, 9] for i in range(6)]

    def logprob_diff(engine) -> float:  # vllm/logprob_diff: mean |vLLM - trainer| over the tokens vLLM sampled
        out = ray.get(engine.generate.remote(prompts, n=1, temperature=1.0, max_tokens=12, logprobs=True))
        diffs = []
        for prompt, (sample,) in zip(prompts, out):
            ids = torch.tensor([prompt + sample["token_ids"]])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
            trainer = logprobs.gather(1, torch.tensor(sample["token_ids"])[:, None])[:, 0]
            diffs.append((torch.tensor(sample["logprobs"]) - trainer).abs())
        return torch.cat(diffs).mean().item()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engines = create_vllm_engines(num_engines=1, tensor_parallel_size=1, pretrain_path=tiny_model, seed=0,
                                      max_model_len=64, enforce_eager=True)
        group = init_weight_sync_group(engines)
        unsynced = logprob_diff(engines[0])
        # what the old first sync sent; complete=False, as model_worker.py syncs under LoRA (layers left out stay)
        broadcast_weights_to_vllm(lora.iter_merged_params(model), engines, group, complete=False)
        mlps_unsynced = logprob_diff(engines[0])
        broadcast_weights_to_vllm(lora.iter_merged_params(model, everything_quantized=True), engines, group,
                                  complete=False)
        synced = logprob_diff(engines[0])
        shutdown_engines(engines)
    finally:
        ray.shutdown()
    assert synced < 1e-4 and min(unsynced, mlps_unsynced) > 10 * synced, (unsynced, mlps_unsynced, synced)


def test_resuming_with_lora_turned_on_or_off_is_refused_in_one_sentence(tmp_path):
    from common.checkpoint import check_settings

    with_lora, without = lora.settings(lora_args()), lora.settings(lora_args(lora_rank=0))
    for saved, now in ((without, with_lora), (with_lora, without)):
        with pytest.raises(UserError, match=f"holds a run made with --lora_rank {saved['--lora_rank']}, not "
                                            f"{now['--lora_rank']}; rerun with --lora_rank"):
            check_settings(saved, now, str(tmp_path))
