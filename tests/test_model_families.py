"""The weight sync on model families the fixtures do not build, mixture-of-experts and hybrid ones included.

transformers 5 holds some families' weights in a layout of its own (MoE experts fused into 3-D tensors, Mixtral's
`block_sparse_moe` renamed `mlp`) and converts them only when it saves. vLLM's loaders read the checkpoint's layout,
so the sync must send exactly what save_pretrained writes: checked here for every family, without an engine. Then,
for the MoE families and GPT-2, one engine each (in one process, tests/try_model_families.py --mode sync) gets a sync
of perturbed weights, and its log-probs must equal the trainer's to float rounding; a sync that leaves one expert
tensor out must not.

The family table (tests/model_family_table.py, docs/models.md) must list every causal LM transformers ships;
check_engine_runs resolves vLLM's spelling of an architecture and refuses what vLLM cannot run, from config.json
alone; and the families the sync's fixes touched (gpt-oss, PhiMoE, Bamba) go through the table's own walk.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.args import UserError
from common.vllm_engine import check_engine_runs, recurrent_layers_in_config
from common.weight_sync import (WeightSyncGroup, broadcast_weights_to_vllm, iter_gathered_params, loadable_names,
                                unknown_to_checkpoint)
from tests.model_family_table import DOCS, causal_lm_families, load_table, markdown_table, tiny_config
from tests.try_model_families import FAMILIES, MOE, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# mean |vLLM - trainer| log-prob after a sync: 3e-7 measured on every family here (float32 on CPU); a stale or
# misplaced tensor gives 1e-2 and more.
ROUNDING_LEVEL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: folder of a tiny model saved by save_pretrained}, built once."""
    root = tmp_path_factory.mktemp("families")
    return {family: write_model(family, str(root / family)) for family in FAMILIES}


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("built", ["from_pretrained", "from_config"])
def test_the_sync_sends_what_save_pretrained_writes(saved, family, built):
    """Names, shapes and values of every tensor, whether the trainer loaded the model (transformers then remembers
    the conversions it applied) or built it from a config (transformers' table for the family applies)."""
    model = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32)
    if built == "from_config":
        state = model.state_dict()
        model = AutoModelForCausalLM.from_config(model.config).float()
        model.load_state_dict(state)
    sent = {name: tensor.clone() for name, tensor in iter_gathered_params(model)}
    written = checkpoint(saved[family])
    assert sorted(sent) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(sent[name], tensor), name
    if family in MOE:
        assert any(".experts.0." in name for name in sent), "the fixture lost its experts"


def test_a_name_the_checkpoint_lacks_stops_the_sync(saved):
    """Qwen2-MoE's in-memory expert names went to vLLM unconverted and vLLM kept its old experts without a word;
    such a name now fails the sync in one sentence, before anything is sent."""
    model = AutoModelForCausalLM.from_pretrained(saved["qwen2_moe"], dtype=torch.float32)
    sync = WeightSyncGroup(group=None, checkpoint_names=loadable_names(list(checkpoint(saved["qwen2_moe"]))))
    in_memory = ((name, p.detach()) for name, p in model.named_parameters() if ".experts." in name)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*checkpoint does not hold"):
        broadcast_weights_to_vllm(in_memory, [], sync)


def test_a_checkpoint_without_the_base_models_prefix_still_matches():
    """GPT-2's checkpoints on the hub name `h.0.attn.c_attn.weight` what transformers calls
    `transformer.h.0.attn.c_attn.weight`; vLLM's loader maps the two, so the sync's check must too."""
    hub = loadable_names(["h.0.attn.c_attn.weight", "wte.weight"])
    assert not unknown_to_checkpoint("transformer.h.0.attn.c_attn.weight", hub)
    assert unknown_to_checkpoint("transformer.h.0.mlp.experts.gate_up_proj", hub)
    saved = loadable_names(["transformer.h.0.attn.c_attn.weight"])
    assert not unknown_to_checkpoint("h.0.attn.c_attn.weight", saved)


@pytest.mark.slow
def test_engines_sample_from_the_trainers_weights_after_a_sync(tmp_path):
    """One sync of perturbed weights per family, then vLLM's log-probs against the trainer's; and a sync that leaves
    an expert tensor out must show (the comparison is what would catch a sync that skips experts)."""
    families = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt2"]
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "try_model_families.py"), "--out", str(tmp_path),
                    "--mode", "sync", "--families", *families, "--json", str(out)], cwd=ROOT, check=True)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(families)
    for family, result in results.items():
        assert result["diff"] <= ROUNDING_LEVEL, f"{family}: vLLM samples from other weights ({result['diff']:.1e})"
        if family in MOE:  # NaN (a fused layer loaded half-way) fails `<=` too
            assert not result["skipped_expert_diff"] <= 100 * ROUNDING_LEVEL, family



def test_every_causal_lm_family_transformers_ships_is_in_the_table():
    """docs/models.md's table lists every causal LM of the transformers installed, as the data file has it: a family
    added by a transformers upgrade fails here until `make test-families` has tried it."""
    table = load_table()
    missing = sorted(set(causal_lm_families()) - set(table))
    assert not missing, f"families transformers ships that the table lacks (run make test-families): {missing}"
    with open(DOCS) as f:
        assert markdown_table(table) in f.read(), "docs/models.md's table is not the data file's (run --docs)"


def family_config(tmp_path, family: str, **changes) -> str:
    """A folder holding only the tiny config.json of `family`, as check_engine_runs reads it before any engine."""
    from common.tiny_model import build_tokenizer

    config = tiny_config(family, build_tokenizer())
    config.architectures = [causal_lm_families()[family]]
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path / family)
    return str(tmp_path / family)


def test_an_architecture_vllm_spells_otherwise_is_resolved_and_an_unknown_one_refused(tmp_path):
    """transformers writes PhimoeForCausalLM where vLLM registers PhiMoEForCausalLM: the engine is told vLLM's
    spelling. One vLLM does not register at all is one sentence naming it and the vLLM version, on GPUs too."""
    import vllm

    assert check_engine_runs(family_config(tmp_path, "phimoe"), use_gpu=False) == {
        "hf_overrides": {"architectures": ["PhiMoEForCausalLM"]}}
    assert check_engine_runs(family_config(tmp_path, "llama"), use_gpu=False) == {}
    for use_gpu in (False, True):
        with pytest.raises(UserError, match=rf"is a BioGptForCausalLM, an architecture vLLM {vllm.__version__} "
                                            r"does not run"):
            check_engine_runs(family_config(tmp_path, "biogpt"), use_gpu=use_gpu)


def test_state_space_layers_are_found_from_the_models_own_config(tmp_path):
    """vLLM 0.32 no longer registers Bamba, so its registry says nothing of Bamba's Mamba layers: the config does
    (Mamba settings, or a recurrent kind in its layer kinds), and on CPU the sentence comes before any engine."""
    with pytest.raises(UserError, match=r"is a BambaForCausalLM, whose state-space \(recurrent\) layers vLLM runs on "
                                        r"GPUs only"):
        check_engine_runs(family_config(tmp_path, "bamba"), use_gpu=False)
    with pytest.raises(UserError, match="an architecture vLLM .* does not run"):  # on GPUs: not registered
        check_engine_runs(family_config(tmp_path, "bamba"), use_gpu=True)


def test_the_layers_of_a_wrapped_text_model_are_read_from_its_text_config(tmp_path):
    """Qwen3.5 lists its layers, Gated DeltaNet linear attention among them, in its text_config: they are read there.
    Only the config can tell where vLLM's registry cannot be asked (its Qwen3.5 module failed to import here)."""
    with open(os.path.join(family_config(tmp_path, "qwen3_5"), "config.json")) as f:
        config = json.load(f)
    assert "layer_types" not in config and recurrent_layers_in_config(config)
    config["text_config"]["layer_types"] = ["full_attention"] * len(config["text_config"]["layer_types"])
    assert not recurrent_layers_in_config(config)


@pytest.mark.slow
def test_the_families_the_sync_fix_touched_sync_and_start_or_are_refused(tmp_path):
    """The walk of tests/model_family_table.py on the families this work touched: gpt-oss, whose loader copies its
    experts and attention sinks past the reload, now lands every tensor (vLLM kept its old experts, 5e-2 off);
    PhiMoE starts under vLLM's own class (it died in vLLM's Transformers backend); Bamba is refused in a sentence."""
    data = tmp_path / "families.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "model_family_table.py"), "--out", str(tmp_path),
                    "--data", str(data), "--families", "gpt_oss", "phimoe", "bamba"], cwd=ROOT, check=True)
    table = json.loads(data.read_text())
    assert table["gpt_oss"]["status"] == "runs", table["gpt_oss"]
    assert table["gpt_oss"]["after_sync"] <= ROUNDING_LEVEL
    assert table["phimoe"]["status"] != "engine failed", table["phimoe"]
    assert table["bamba"]["status"] == "refused" and "state-space" in table["bamba"]["reason"]


def test_the_first_steps_gap_is_told_apart_from_rounding():
    """ppo_ray.py's first step prints its vllm/logprob_diff, taken before any sync: in float32 at rounding level it
    says so; above it (DeepSeek's MLA kernel on CPU: 1.7e-3) it names the engine, not the sync, and the IS
    correction; in bfloat16, whose rounding no bound here covers, it gives the number without a verdict."""
    from common.vllm_engine import FLOAT32_ROUNDING, engine_gap_line

    assert "float rounding" in engine_gap_line(4e-7, "float32")
    above = engine_gap_line(1.7e-3, "float32")
    assert "1.70e-03" in above and "otherwise than transformers" in above and "--vllm_is_correction" in above
    assert "otherwise" not in engine_gap_line(FLOAT32_ROUNDING, "float32")
    bf16 = engine_gap_line(1.7e-3, "bfloat16")
    assert "(bfloat16)" in bf16 and "rounding" not in bf16 and "otherwise" not in bf16
