"""Bad inputs and faults, every script: one sentence on stderr naming the fix, the exit code, no traceback, nothing
written, and what was saved left intact.

The fast cases fail before a model loads, so they run each script's own `main` through `run_main` in this process
(the `__main__` path minus interpreter start-up); the slow ones run the scripts as a user does and stop them with
Ctrl-C, SIGTERM or a killed worker mid-run, or fill their disk while they save. docs/reliability.md lists each
fault, what the user sees and the test that shows it.
"""

import importlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, metrics, run_script

from common.args import parse_args, run_main
from common.data import load_records
from common.output_lock import release_output_folders

TRAINERS = ["sft", "rm", "dpo", "kto"]
SCRIPTS = TRAINERS + ["ppo_ray", "rejection_sampling"]
RULE = os.path.join(ROOT, "common", "synthetic_task.py") + ":reward_fn"


def command(script: str, model: str, task: dict, out: str, *extra: str) -> list[str]:
    """A run of `script` that would work, on the tiny model and the task, with `extra` flags last (they win)."""
    data = {"sft": task["sft_train"], "rm": task["pref_train"], "dpo": task["pref_train"], "kto": task["kto_train"]}
    if script in data:
        return ["--pretrain", model, "--dataset", data[script], "--max_len", "64", "--output_dir", out, *extra]
    if script == "ppo_ray":
        return ["--pretrain", model, "--prompt_data", task["prompts_train"], "--reward_fn", RULE,
                "--prompt_max_len", "32", "--generate_max_len", "8", "--output_dir", out, *extra]
    return ["--pretrain", model, "--dataset", task["prompts_train"], "--reward_fn", RULE, "--max_model_len", "64",
            "--generate_max_len", "8", "--output_dir", out, *extra]


def run_in_process(script: str, argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of `python script.py argv`, run here: parse_args + run_main(main), as __main__ does."""
    module = importlib.import_module(script)
    try:
        with pytest.raises(SystemExit) as stop:
            run_main(module.main, parse_args(module.Args, argv))
    finally:  # run_main sets these for the run; this process goes on
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        release_output_folders()
    return stop.value.code, capsys.readouterr().err


def check_refused(code: int, stderr: str, words: str, out: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], stderr[-2000:]
    assert lines[0].endswith("."), lines[0]
    assert not os.path.exists(out) or os.path.isfile(out), f"{out} was written"


# ------------------------------------------------------------------------------------------------ the fixtures
@pytest.fixture(scope="module")
def short_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model, said to take only 32 positions (as a model built for short inputs would)."""
    folder = tmp_path_factory.mktemp("short_model")
    for name in os.listdir(tiny_model):
        os.symlink(os.path.join(tiny_model, name), folder / name)
    config = json.load(open(os.path.join(tiny_model, "config.json")))
    os.remove(folder / "config.json")
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    return str(folder)


def with_config(tiny_model: str, folder, **changes) -> str:
    """The tiny model's files, its config.json changed."""
    folder.mkdir()
    for name in os.listdir(tiny_model):
        if name != "config.json":
            os.symlink(os.path.join(tiny_model, name), folder / name)
    config = json.load(open(os.path.join(tiny_model, "config.json")))
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


@pytest.fixture(scope="module")
def not_causal_lms(tiny_model, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("not_causal_lms")
    return {"reward model": with_config(tiny_model, folder / "rm", architectures=["LlamaForSequenceClassification"]),
            "t5": with_config(tiny_model, folder / "t5", model_type="t5",
                              architectures=["T5ForConditionalGeneration"])}


@pytest.fixture(scope="module")
def other_tokenizer_model(tiny_model, tmp_path_factory) -> str:
    """A model like the tiny one whose tokenizer has one token more."""
    from transformers import AutoTokenizer

    from common.tiny_model import build_model

    folder = str(tmp_path_factory.mktemp("other_tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_tokens(["<extra>"])
    build_model(tokenizer, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def damaged_models(tiny_model, tmp_path_factory) -> dict:
    """The tiny model as interrupted downloads leave it: model.safetensors cut short, or saved in shards of which
    the last is missing."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("damaged_models")
    cut, sharded = folder / "cut_short", folder / "shard_missing"
    cut.mkdir()
    for name in os.listdir(tiny_model):
        if name != "model.safetensors":
            os.symlink(os.path.join(tiny_model, name), cut / name)
    weights = open(os.path.join(tiny_model, "model.safetensors"), "rb").read()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) * 2 // 3])
    shutil.copytree(cut, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(sharded, max_shard_size="1MB")
    shards = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(shards) > 1, shards
    os.remove(sharded / shards[-1])
    return {"cut short": str(cut), "shard missing": str(sharded), "missing shard's name": shards[-1]}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("bad_files")
    (folder / "a_file").write_text("not a folder\n")
    (folder / "no_config").mkdir()
    (folder / "empty.jsonl").write_text("")
    (folder / "malformed.jsonl").write_text('{"prompt": "What is 1+1?"}\n{"prompt": "What is 2+2?"\n')
    (folder / "other_keys.jsonl").write_text('{"question": "What is 1+1?", "answer": "2"}\n')
    (folder / "three.jsonl").write_text("".join(f'{{"prompt": "What is {i}+1?", "label": "{i + 1}"}}\n'
                                                for i in range(3)))
    lines = (folder / "three.jsonl").read_bytes().splitlines(keepends=True) * 2
    lines.insert(4, latin1({"prompt": "Café: what is 1+1?", "label": "2"}))  # line 5
    (folder / "not_utf8.jsonl").write_bytes(b"".join(lines))
    return {name: str(folder / name) for name in ("a_file", "no_config", "empty.jsonl", "malformed.jsonl",
                                                  "other_keys.jsonl", "three.jsonl", "not_utf8.jsonl")}


def latin1(row: dict) -> bytes:
    """A JSON line as a spreadsheet export or an old editor writes it, in Latin-1 where UTF-8 belongs: its é is the
    byte 0xe9, which UTF-8 reads as the start of a character the next bytes do not continue."""
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("latin-1")


# ------------------------------------------------------------------------------------------ fast: flags, files
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("fault,words", [
    ("model path missing", "does not exist; give a Hugging Face model folder"),
    ("model folder without config.json", "has no config.json; give a Hugging Face model folder"),
    ("output dir is a file", "is a file; give a folder"),
    ("lengths beyond the model's positions", "more than --pretrain"),
    ("a reward model where the policy belongs", "is a LlamaForSequenceClassification, not a causal language model"),
    ("an encoder-decoder model", "is a 't5' model, which transformers cannot load as a causal language model"),
    ("model.safetensors cut short", "model.safetensors is damaged ("),
    ("a shard missing", "a shard its model.safetensors.index.json names, is missing"),
])
def test_refused_before_anything_loads(script, fault, words, tiny_model, short_model, not_causal_lms, task,
                                       bad_files, damaged_models, tmp_path, capsys):
    if script == "rm" and fault == "a reward model where the policy belongs":
        pytest.skip("rm.py trains a scalar head on any decoder-only backbone, a reward model's included")
    out = str(tmp_path / "out")
    model = {"model path missing": str(tmp_path / "no_such_model"),
             "model folder without config.json": bad_files["no_config"],
             "lengths beyond the model's positions": short_model,
             "a reward model where the policy belongs": not_causal_lms["reward model"],
             "an encoder-decoder model": not_causal_lms["t5"],
             "model.safetensors cut short": damaged_models["cut short"],
             "a shard missing": damaged_models["shard missing"]}.get(fault, tiny_model)
    if fault == "output dir is a file":
        out = bad_files["a_file"]
    code, stderr = run_in_process(script, command(script, model, task, out), capsys)
    check_refused(code, stderr, words, out)


@pytest.mark.parametrize("script", ["ppo_ray", "rejection_sampling"])
@pytest.mark.parametrize("extra,words", [
    (["--reward_fn", "no_such_file.py:score"], "no_such_file.py"),
    (["--reward_fn", RULE.replace(":reward_fn", ":no_such_function")], "no_such_function"),
    (["--reward_weights", "1", "2"], "--reward_weights has 2 weights for 1 reward sources"),
])
def test_reward_flags_that_cannot_work_are_refused(script, extra, words, tiny_model, task, tmp_path, capsys):
    out = str(tmp_path / "out")
    code, stderr = run_in_process(script, command(script, tiny_model, task, out, *extra), capsys)
    check_refused(code, stderr, words, out)


@pytest.mark.parametrize("extra,words", [
    (["--routing_replay"], "is a dense model"),
    (["--keep_sampling_mask"], "--top_p 1.0 samples from the whole vocabulary"),
])
def test_sampler_matching_flags_that_cannot_apply_are_refused(extra, words, tiny_model, task, tmp_path, capsys):
    out = str(tmp_path / "out")
    code, stderr = run_in_process("ppo_ray", command("ppo_ray", tiny_model, task, out, *extra), capsys)
    check_refused(code, stderr, words, out)


@pytest.mark.parametrize("extra,words", [
    (["--loss_type", "dpo"], "--loss_type dpo is not one of sigmoid, ipo, hinge, robust, simpo, orpo"),
    (["--loss_type", "robust"], "--loss_type robust corrects for labels flipped at the rate --label_smoothing"),
    (["--loss_type", "simpo", "--ref_pretrain", "x"], "--loss_type simpo uses no reference model"),
    (["--loss_type", "orpo", "--nll_loss_coef", "1"], "ORPO's loss holds the chosen responses' NLL"),
    (["--ipo", "--loss_type", "hinge"], "--ipo asks for the IPO loss but --loss_type is hinge"),
])
def test_dpo_loss_flags_that_do_not_go_together_are_refused(extra, words, tiny_model, task, tmp_path, capsys):
    out = str(tmp_path / "out")
    code, stderr = run_in_process("dpo", command("dpo", tiny_model, task, out, *extra), capsys)
    check_refused(code, stderr, words, out)


@pytest.mark.parametrize("script,flag", [("ppo_ray", "--reward_pretrain"), ("ppo_ray", "--critic_pretrain"),
                                         ("rejection_sampling", "--reward_pretrain"),
                                         ("ppo_ray", "--teacher_pretrain")])
def test_a_model_with_another_tokenizer_is_refused(script, flag, tiny_model, other_tokenizer_model, task, tmp_path,
                                                   capsys):
    """It would read the policy's token ids as other tokens: scores and values of other texts."""
    out = str(tmp_path / "out")
    code, stderr = run_in_process(script, command(script, tiny_model, task, out, flag, other_tokenizer_model), capsys)
    check_refused(code, stderr, f"{flag} {other_tokenizer_model} has a different tokenizer from the policy", out)


@pytest.mark.parametrize("script,flag", [("ppo_ray", "--reward_pretrain"), ("ppo_ray", "--critic_pretrain"),
                                         ("rejection_sampling", "--reward_pretrain"),
                                         ("ppo_ray", "--teacher_pretrain")])
def test_an_encoder_decoder_scorer_is_refused(script, flag, tiny_model, not_causal_lms, task, tmp_path, capsys):
    """A reward or value is read at a sequence's last token, which only a decoder-only model's summarises."""
    out = str(tmp_path / "out")
    t5 = not_causal_lms["t5"]
    code, stderr = run_in_process(script, command(script, tiny_model, task, out, flag, t5), capsys)
    check_refused(code, stderr, f"{flag} {t5} is a 't5' model", out)


@pytest.mark.parametrize("script,flag", [("ppo_ray", "--reward_pretrain"), ("ppo_ray", "--critic_pretrain"),
                                         ("rejection_sampling", "--reward_pretrain"), ("dpo", "--ref_pretrain"),
                                         ("kto", "--ref_pretrain"), ("ppo_ray", "--teacher_pretrain")])
@pytest.mark.parametrize("fault", ["cut short", "shard missing"])
def test_a_damaged_scorer_or_reference_is_refused_naming_the_file(script, flag, fault, tiny_model, damaged_models,
                                                                   task, tmp_path, capsys):
    """An interrupted download of a model besides the policy: safetensors' "incomplete metadata, file not fully
    covered" from deep in a worker, or a shard not found, once the run had started."""
    out = str(tmp_path / "out")
    damaged = damaged_models[fault]
    code, stderr = run_in_process(script, command(script, tiny_model, task, out, flag, damaged), capsys)
    name = "model.safetensors" if fault == "cut short" else damaged_models["missing shard's name"]
    check_refused(code, stderr, f"{flag} {damaged}: {name}", out)
    assert "fetch that file again" in stderr


@pytest.mark.parametrize("script", ["ppo_ray", "rejection_sampling"])
@pytest.mark.parametrize("data,words", [
    ("empty.jsonl", "is empty"),
    ("malformed.jsonl", "line 2"),
    ("other_keys.jsonl", "'prompt'"),
    ("three.jsonl", "has 3 usable prompts, fewer than one rollout batch; lower --rollout_batch_size to 3 or less"),
    ("not_utf8.jsonl", "line 5: byte 0xe9 is not UTF-8 text"),
])
def test_prompt_data_faults_name_the_file_and_the_fix(script, data, words, tiny_model, task, bad_files, tmp_path,
                                                      capsys):
    if data == "three.jsonl" and script == "rejection_sampling":
        pytest.skip("rejection sampling takes the prompts it has, in chunks of any size")
    out = str(tmp_path / "out")
    flag = "--prompt_data" if script == "ppo_ray" else "--dataset"
    argv = command(script, tiny_model, task, out)
    argv[argv.index(flag) + 1] = bad_files[data]
    code, stderr = run_in_process(script, argv, capsys)
    check_refused(code, stderr, words, out)
    assert bad_files[data] in stderr


GOOD_ROW = {"sft": {"prompt": "What is 1+1?", "response": "2"},
            "rm": {"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"},
            "dpo": {"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"},
            "kto": {"prompt": "What is 1+1?", "response": "2", "label": True}}
RESPONSE_KEY = {"sft": "response", "rm": "chosen", "dpo": "chosen", "kto": "response"}


@pytest.mark.parametrize("script", TRAINERS)
@pytest.mark.parametrize("fault", ["file missing", "empty", "malformed line", "not UTF-8", "missing key",
                                   "null response", "not a boolean label", "fewer samples than one batch",
                                   "every sample too long", "batch sizes that do not divide"])
def test_training_data_faults_name_the_file_and_the_fix(script, fault, tiny_model, task, tmp_path, capsys):
    """Checked before the distributed world or DeepSpeed starts: a bad dataset costs the user seconds."""
    if fault == "not a boolean label" and script != "kto":
        pytest.skip("only KTO's data has labels")
    good, key = GOOD_ROW[script], RESPONSE_KEY[script]
    rows, extra, words = [good] * 16, [], None
    if fault == "empty":
        rows, words = [], "is empty"
    elif fault == "missing key":
        rows = [{("answer" if k == key else k): v for k, v in good.items()}] * 16
        words = f"sample 0: no key '{key}'; the keys present are"
    elif fault == "null response":
        rows, words = [good, {**good, key: None}] * 8, f"sample 1: '{key}' must be a response text, got NoneType"
    elif fault == "not a boolean label":
        rows, words = [{**good, "label": "yes"}] * 16, "sample 0: 'label' must be true or false"
    elif fault == "fewer samples than one batch":
        rows, extra = [good] * 3, ["--train_batch_size", "8", "--micro_train_batch_size", "2"]
        words = "fewer than one batch; lower --train_batch_size below 8"
    elif fault == "every sample too long":
        rows, words = [{**good, "prompt": "What is 1+1? " * 40}] * 16, "--max_len 64"
    elif fault == "batch sizes that do not divide":
        extra = ["--train_batch_size", "10", "--micro_train_batch_size", "4"]
        words = "--train_batch_size 10 must be a multiple of --micro_train_batch_size 4 x 1 ranks"
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if fault == "malformed line":
        dataset.write_text(json.dumps(good) + '\n{"prompt": "What is 2+2?"\n')
        words = "line 2: not valid JSON"
    elif fault == "not UTF-8":
        lines = dataset.read_bytes().splitlines(keepends=True)
        lines[4] = latin1({**good, "prompt": "Café: what is 1+1?"})
        dataset.write_bytes(b"".join(lines))
        words = "line 5: byte 0xe9 is not UTF-8 text"
    elif fault == "file missing":
        dataset, words = tmp_path / "no_such_data.jsonl", "no_such_data.jsonl does not exist; check the path"
    out = str(tmp_path / "out")
    argv = command(script, tiny_model, task, out, *extra)
    argv[argv.index("--dataset") + 1] = str(dataset)
    code, stderr = run_in_process(script, argv, capsys)
    check_refused(code, stderr, words, out)
    assert str(dataset) in stderr or fault == "batch sizes that do not divide"


def test_a_kto_eval_set_of_one_sample_is_refused(tiny_model, task, tmp_path, capsys):
    """KTO's reference point pairs each prompt with another sample's response: one eval sample has none."""
    dataset = tmp_path / "eval.jsonl"
    dataset.write_text(json.dumps(GOOD_ROW["kto"]) + "\n")
    out = str(tmp_path / "out")
    code, stderr = run_in_process("kto", command("kto", tiny_model, task, out, "--eval_dataset", str(dataset)), capsys)
    check_refused(code, stderr, "has 1 usable sample; KTO's reference point pairs each prompt with another", out)


def test_ppo_ray_refuses_to_resume_a_checkpoint_of_other_settings(tiny_model, task, tmp_path, capsys):
    """Another --rollout_batch_size would walk the prompts in another order from the saved step: silently other
    data. The check runs before Ray starts, and the checkpoint is left as it was."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    state = out / "checkpoints" / "driver_state.json"
    saved = {"--seed": 42, "--rollout_batch_size": 512, "--n_samples_per_prompt": 1, "--train_batch_size": 128,
             "--actor_num_workers": 1}
    state.write_text(json.dumps({"step": 4, "kl_ctl": {}, "settings": saved}))
    before = state.read_text()
    argv = command("ppo_ray", tiny_model, task, str(out), "--rollout_batch_size", "256")
    code, stderr = run_in_process("ppo_ray", argv, capsys)
    assert code == 2 and stderr.count("error: ") == 1 and "Traceback" not in stderr, stderr
    assert "holds a run made with --rollout_batch_size 512, not 256; rerun with --rollout_batch_size 512" in stderr
    assert state.read_text() == before
    # one actor worker trains at ZeRO-0 unless --zero_stage says otherwise; a stage-3 checkpoint would not load
    state.write_text(json.dumps({"step": 4, "kl_ctl": {}, "settings": {"the actor's --zero_stage": "3"}}))
    code, stderr = run_in_process("ppo_ray", argv, capsys)
    assert code == 2 and "holds a run made with the actor's --zero_stage 3, not 0; rerun with the actor's " \
                         "--zero_stage 3 to resume it" in stderr, stderr


@pytest.mark.parametrize("script", TRAINERS)
@pytest.mark.parametrize("flag,value,saved", [("--train_batch_size", 4, 8), ("--seed", 1, 42),
                                              ("the number of ranks", None, 2),
                                              ("--zero_stage", 3, "1 or 2")])  # DeepSpeed: a bare AssertionError
def test_a_trainer_refuses_to_resume_a_checkpoint_of_other_settings_before_loading(script, flag, value, saved,
                                                                                   tiny_model, task, tmp_path,
                                                                                   capsys, monkeypatch):
    """Another batch size or seed would train on other samples from the saved step; another number of ranks would
    fail deep inside DeepSpeed. Refused before the model loads (it took a model load, and on a large model
    minutes), the checkpoint left as it was."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    settings = out / "checkpoints" / "settings.json"
    settings.write_text(json.dumps({"--train_batch_size": 8, "--seed": 42, "the number of ranks": 1, flag: saved}))
    (out / "checkpoints" / "latest").write_text("step_4")
    argv = command(script, tiny_model, task, str(out), "--train_batch_size", "8", "--micro_train_batch_size", "4",
                   "--seed", "42", *([flag, str(value)] if value is not None else []))
    def too_late():
        raise AssertionError("refused only once the distributed world formed and the model was about to load")

    monkeypatch.setattr(importlib.import_module(script), "init_distributed", too_late)
    code, stderr = run_in_process(script, argv, capsys)
    assert code == 2 and stderr.count("error: ") == 1 and "Traceback" not in stderr, stderr
    shown = value if value is not None else 1
    assert f"holds a run made with {flag} {saved}, not {shown}; rerun with {flag} {saved} to resume it" in stderr
    assert sorted(os.listdir(out)) == ["checkpoints"] and sorted(os.listdir(out / "checkpoints")) == [
        "latest", "settings.json"]


@pytest.mark.parametrize("script", TRAINERS)
@pytest.mark.parametrize("flag,saved", [("the script", "another.py"), ("--pretrain", "other_model"),
                                        ("--learning_rate", 0.5)])
def test_a_trainer_refuses_to_resume_another_runs_checkpoint(script, flag, saved, tiny_model, task, tmp_path, capsys):
    """A command pointed at a folder holding another run's checkpoints (another script, model or schedule; the
    default --output_dir makes it easy) resumed that run's weights, optimizer and step, and where that step was
    past its own end saved that run's model as its own. Refused before the model loads."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "settings.json").write_text(json.dumps({flag: saved}))
    (out / "checkpoints" / "latest").write_text("step_4")
    code, stderr = run_in_process(script, command(script, tiny_model, task, str(out)), capsys)
    assert code == 2 and stderr.count("error: ") == 1 and "Traceback" not in stderr, stderr
    assert f"holds a run made with {flag} {saved}, not " in stderr and "give another --output_dir" in stderr, stderr


@pytest.mark.slow
def test_a_trainer_refuses_to_resume_a_run_past_its_own_end(tiny_model, task, tmp_path):
    """With --max_steps lowered below the checkpoint's step no step ran, and the checkpoint's model was saved as
    this run's. Raising --max_steps resumes and trains on. Checked once the data is read, before the model loads."""
    out = str(tmp_path / "out")
    run_script("sft.py", command("sft", tiny_model, task, out, "--max_steps", "2", "--save_steps", "2"))
    model = open(os.path.join(out, "model.safetensors"), "rb").read()
    result = run_script("sft.py", command("sft", tiny_model, task, out, "--max_steps", "1"), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "holds a run at step 2, past this run's end at step 1; raise --max_steps to 2 or more" in result.stderr
    assert open(os.path.join(out, "model.safetensors"), "rb").read() == model
    run_script("sft.py", command("sft", tiny_model, task, out, "--max_steps", "3"))
    assert [m["step"] for m in metrics(out) if "train/loss" in m][-1] == 3


def test_rejection_sampling_refuses_to_resume_samples_of_other_prompts(tiny_model, task, tmp_path, capsys):
    """A resumed iteration reused its generations.jsonl after checking only the counts: with the dataset changed at
    the same path, the old responses were scored against the new labels and trained after the new prompts."""
    out = tmp_path / "out"
    first = load_records(task["prompts_train"])[:2]
    run = out  # --iterations 0: the one round writes into --output_dir itself
    run.mkdir()
    other = [{"prompt": row["prompt"] + " (changed)", "label": row.get("label"), "responses": ["1", "2"],
              "truncated": [False, False]} for row in first]
    (run / "generations.jsonl").write_text("".join(json.dumps(row) + "\n" for row in other))
    argv = command("rejection_sampling", tiny_model, task, str(out), "--max_samples", "2", "--n_samples_per_prompt",
                   "2")
    code, stderr = run_in_process("rejection_sampling", argv, capsys)
    assert code == 2 and stderr.count("error: ") == 1 and "Traceback" not in stderr, stderr
    assert "holds responses to other prompts or labels than this iteration's" in stderr, stderr


def test_rejection_sampling_defaults_its_context_to_the_models(short_model, task, tmp_path, capsys):
    """The engines' context defaults to what the model takes (it was 2048 whatever the model, and vLLM refused a
    32-position model with a 30-line traceback); a response as long as the context leaves no room for a prompt."""
    out = str(tmp_path / "out")
    argv = command("rejection_sampling", short_model, task, out)
    argv = [w for i, w in enumerate(argv) if "--max_model_len" not in argv[max(i - 1, 0): i + 1]]
    code, stderr = run_in_process("rejection_sampling", argv + ["--generate_max_len", "32"], capsys)
    check_refused(code, stderr, "--generate_max_len 32 leaves no room for a prompt in --max_model_len 32", out)


def test_a_tokenizer_without_pad_pads_with_eos_and_one_without_eos_is_refused(tiny_model, tmp_path):
    from common.args import UserError
    from common.deepspeed_utils import load_tokenizer

    for name in os.listdir(tiny_model):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(tiny_model, name), tmp_path / name)
    config = json.load(open(os.path.join(tiny_model, "tokenizer_config.json")))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None}))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.pad_token is not None and tokenizer.pad_token == tokenizer.eos_token
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None, "eos_token": None}))
    with pytest.raises(UserError, match=r"its tokenizer has no end-of-sequence token, .*; set eos_token in its"):
        load_tokenizer(str(tmp_path))


def test_a_deepspeed_op_build_lock_is_waited_on_aloud_and_a_stale_one_refused(tmp_path, monkeypatch, capsys):
    """torch waits without a word and without end on <TORCH_EXTENSIONS_DIR>/<op>/lock, which a killed build leaves."""
    import threading

    from common.args import UserError
    from common.deepspeed_utils import wait_for_op_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    threading.Timer(1.5, lock.unlink).start()  # another process finishing its build
    wait_for_op_builds()
    assert not lock.exists() and "another process is building that DeepSpeed op" in capsys.readouterr().err

    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(UserError, match=r"is 60 minutes old: a DeepSpeed op build that was killed left it behind"):
        wait_for_op_builds()


IN_FLIGHT = """
import sys
import torch
import torch.distributed as dist
from common.args import UserError, run_main

def main(outcome):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    held = dist.group.WORLD  # as DeepSpeed's engine holds its groups until the interpreter's last collection
    out, x = torch.empty(100_000), torch.ones(100_000)
    for _ in range(20_000):  # each with tensors of its own (views) that Python no longer holds
        dist.all_gather([out[:]], x[:], async_op=True)
    if outcome == "error":
        raise UserError("the data ran out.")

run_main(main, sys.argv[1])
"""


@pytest.mark.parametrize("outcome,code", [("done", 0), ("error", 2)])
def test_a_process_with_collectives_in_flight_ends_with_its_own_exit_code(outcome, code, tmp_path):
    """A trainer's last collectives may still be finishing in gloo's threads when it ends. Left to the
    interpreter's exit, this script was aborted by the C++ runtime (exit code -6) in each of 4 runs."""
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    result = subprocess.run([sys.executable, str(script), outcome], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stderr.strip() == ("error: the data ran out." if code else ""), result.stderr[-2000:]


TWO_STOPS = """
import sys
import time
from common.args import run_main

def main(_):
    print("training", flush=True)
    time.sleep(60)

def saved(_):
    print("naming what survives", flush=True)
    time.sleep(2)  # the second stop lands here
    return "the checkpoint of step 5 in ckpt is intact"

run_main(main, None, saved=saved)
"""


def test_a_second_stop_does_not_cut_the_first_ones_sentence_short(tmp_path):
    """Ctrl-C under `deepspeed --num_gpus 2` reaches rank 0 twice (from the terminal, then from the launcher). The
    second used to land while run_main named the surviving checkpoint, and ended the run in a traceback (CI saw it
    once, in the sft stop test below)."""
    script = tmp_path / "two_stops.py"
    script.write_text(TWO_STOPS)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline() == "training\n"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "naming what survives\n"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip() == ("error: interrupted; the checkpoint of step 5 in ckpt is intact. Rerun the same "
                              "command to resume."), stderr[-2000:]


PEER_STOPS_FIRST = """
import sys
import time
import torch
import torch.distributed as dist
from common.args import run_main

def main(_):
    dist.init_process_group("gloo")
    dist.barrier()
    print("training", flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # waits for rank 1, which stops instead of joining
    time.sleep(60)

run_main(main, None, saved=lambda _: "the checkpoint of step 5 in ckpt is intact")
"""


def test_a_rank_whose_peer_stopped_first_still_names_what_survives(tmp_path):
    """Ctrl-C reaches every rank, but a busy machine may run rank 0's handler only after rank 1 has handled its
    own and exited. Rank 0's collective then fails first ("Connection reset by peer"); CI once saw that
    traceback in place of the sentence, in the sft stop test below. Here rank 0's stop comes half a second late."""
    from common.net import free_port

    script = tmp_path / "peer_stops_first.py"
    script.write_text(PEER_STOPS_FIRST)
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
           "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
    try:
        assert [rank.stdout.readline() for rank in ranks] == ["training\n"] * 2
        time.sleep(0.5)  # rank 0 is in its all_reduce
        ranks[1].send_signal(signal.SIGINT)
        assert ranks[1].wait(timeout=60) == 130
        time.sleep(0.5)
        ranks[0].send_signal(signal.SIGINT)
        _, stderr = ranks[0].communicate(timeout=60)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert ranks[0].returncode == 130, stderr[-2000:]
    assert stderr.strip() == ("error: interrupted; the checkpoint of step 5 in ckpt is intact. Rerun the same "
                              "command to resume."), stderr[-2000:]


# ------------------------------------------------------------------------------------ slow: stopped mid-run
def snapshot(folder: str) -> list[tuple[str, float]]:
    return sorted((os.path.relpath(os.path.join(d, f), folder), os.path.getmtime(os.path.join(d, f)))
                  for d, _, files in os.walk(folder) for f in files)


@pytest.mark.slow
def test_a_disk_that_fills_while_saving_leaves_the_last_checkpoint_whole(tiny_model, task, tmp_path):
    """A disk that fills while step 4 is saved (simulated by a file-size limit the checkpoint's largest file
    exceeds: the kernel then fails the write as it does on a full disk) stops the run with one sentence; step 2
    stays the latest, and the rerun resumes it."""
    out = str(tmp_path / "sft")
    argv = command("sft", tiny_model, task, out, "--train_batch_size", "8", "--micro_train_batch_size", "8",
                   "--max_steps", "2", "--save_steps", "2")
    run_script("sft.py", argv)
    checkpoints = os.path.join(out, "checkpoints")
    before = snapshot(checkpoints)
    argv[argv.index("--max_steps") + 1] = "4"

    largest = max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(checkpoints) for f in files)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (largest // 2, largest // 2))  # noqa: E731
    full = subprocess.run([sys.executable, os.path.join(ROOT, "sft.py"), *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, preexec_fn=limit)
    errors = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
    assert full.returncode == 2 and len(errors) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert errors[0].startswith(f"error: could not write the checkpoint of step 4 into {checkpoints} ("), errors[0]
    assert errors[0].endswith(f"the checkpoint of step 2 in {checkpoints} is intact. Make room there and rerun the "
                              f"same command to resume."), errors[0]
    assert snapshot(checkpoints) == before  # every file of step 2 as it was, nothing of step 4 left behind
    assert not os.listdir(os.path.join(checkpoints, ".partial"))  # the failed step's files are gone

    assert f"resumed from {checkpoints} at step 2" in run_script("sft.py", argv).stdout
    assert open(os.path.join(checkpoints, "latest")).read() == "step_4"


def losses(out: str) -> dict[int, float]:
    """train/loss by step from metrics.jsonl; a line the run is still writing is left for the next read."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return {m["step"]: m["train/loss"] for m in rows if "train/loss" in m}


def stop_after(script: str, argv: list[str], out: str, nprocs: int, sig: int, step: int) -> tuple[int, str]:
    """Run the script until it has logged `step`, then stop it with `sig` as a user or a scheduler would; returns
    (exit code, output)."""
    proc = run_script(f"{script}.py", argv, nprocs=nprocs, background=True)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline and not (
            os.path.exists(os.path.join(out, "metrics.jsonl")) and max(losses(out), default=0) >= step):
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    # Ctrl-C reaches every process of the terminal's foreground group: here the group this test started, and no
    # other; a scheduler's SIGTERM, the script's process
    os.killpg(proc.pid, sig) if nprocs > 1 else os.kill(proc.pid, sig)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


@pytest.mark.slow
@pytest.mark.parametrize("script,sig,nprocs,extra", [
    ("sft", signal.SIGINT, 2, ()),  # Ctrl-C in the terminal of `deepspeed --num_gpus 2 sft.py`
    ("rm", signal.SIGTERM, 1, ()),  # a scheduler's stop
    ("dpo", signal.SIGINT, 1, ()),
    ("kto", signal.SIGTERM, 1, ("--lora_rank", "8")),  # LoRA: the adapters and their optimizer state resume
], ids=["sft-SIGINT-2", "rm-SIGTERM-1", "dpo-SIGINT-1", "kto-SIGTERM-1-lora"])
def test_a_stopped_trainer_says_what_survives_and_its_rerun_repeats_the_same_losses(script, sig, nprocs, extra,
                                                                                     tiny_model, task, tmp_path):
    """Stopped a step or more after a checkpoint: one sentence naming it, and the rerun of the same command resumes
    there and trains the steps the stopped run had already logged to the same losses. (The same command, --max_steps
    included: the learning rate schedule stretches over --max_steps, so a rerun given fewer steps trains others.)"""
    out = str(tmp_path / script)
    argv = command(script, tiny_model, task, out, "--train_batch_size", "8", "--micro_train_batch_size", "4",
                   "--max_steps", "400", "--save_steps", "5", "--logging_steps", "1", *extra)
    returncode, output = stop_after(script, argv, out, nprocs, sig, 6)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    latest = int(open(os.path.join(out, "checkpoints", "latest")).read().strip().removeprefix("step_"))
    assert len(errors) == 1 and errors[0] == (f"error: interrupted; the checkpoint of step {latest} in "
                                              f"{os.path.join(out, 'checkpoints')} is intact. Rerun the same command "
                                              f"to resume."), output[-3000:]
    if nprocs == 1:
        assert returncode == 130 and "Traceback" not in output, output[-3000:]
    else:  # DeepSpeed's runner, waiting for its launcher, prints a KeyboardInterrupt of its own; no rank does
        assert output.count("Traceback") <= 1, output[-3000:]
        assert not re.search(rf'File "{re.escape(ROOT)}/(?!\.venv/)', output), output[-3000:]  # a frame of ours

    before = losses(out)
    assert max(before) > latest, before  # steps the rerun will train again
    os.remove(os.path.join(out, "metrics.jsonl"))  # what the rerun logs, alone: it keeps no rows of a missing file
    _, output = stop_after(script, argv, out, nprocs, sig, max(before))
    assert f"resumed from {os.path.join(out, 'checkpoints')} at step {latest}" in output, output[-3000:]
    after = losses(out)
    assert min(after) == latest + 1, sorted(after)
    for step in range(latest + 1, max(before) + 1):
        assert after[step] == pytest.approx(before[step], rel=1e-4), (step, before, after)  # as test_sft's
    if "--lora_rank" in argv:  # adapters of another rank would not fit the checkpoint: refused before loading
        argv[argv.index("--lora_rank") + 1] = "4"
        refused = run_script(f"{script}.py", argv, check=False)
        assert refused.returncode == 2 and "holds a run made with --lora_rank 8, not 4" in refused.stderr, refused


def stop_ppo_ray(argv: list[str], out: str, stop) -> tuple[int, str, int]:
    """Run ppo_ray.py until it commits a checkpoint newer than the one it may have resumed from, call stop(pid of
    what placement.json records) on it; returns (exit code, output, seconds from the stop to the exit)."""
    state = os.path.join(out, "checkpoints", "driver_state.json")
    before = json.load(open(state))["step"] if os.path.exists(state) else 0
    proc = run_script("ppo_ray.py", argv, background=True)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline and (
            not os.path.exists(state) or json.load(open(state))["step"] == before):
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    stop(proc.pid, json.load(open(os.path.join(out, "placement.json"))))
    stopped = time.time()
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output, time.time() - stopped


@pytest.mark.slow
def test_ppo_ray_stopped_by_a_dead_worker_engine_or_sigterm_says_what_survives_and_resumes(tiny_model, task, tmp_path):
    """A killed actor rank 1 would leave rank 0 in a collective until the process group's timeout (30 minutes);
    SIGTERM met Ray's own handler, which aborted the driver. Each stop, a dead vLLM engine's and a reward function's
    that raises too, now ends in one sentence naming the checkpoint that survives, and each rerun of the same command
    resumes from it."""
    out = str(tmp_path / "ppo")
    argv = command("ppo_ray", tiny_model, task, out, "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2",
                   "--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
                   "--actor_num_workers", "2", "--max_steps", "30", "--save_steps", "2")
    state = os.path.join(out, "checkpoints", "driver_state.json")
    checkpoints = os.path.join(out, "checkpoints")

    def stopped_with(stop, code: int, words: str) -> int:
        """Run until a new checkpoint, stop(pid, placement); check the one sentence; the step that survives."""
        exit_code, output, took = stop_ppo_ray(argv, out, stop)
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert exit_code == code and len(errors) == 1 and "Traceback" not in output, output[-3000:]
        saved = json.load(open(state))["step"]
        assert re.search(words, errors[0]) and f"checkpoint of step {saved} in {checkpoints} is intact" in errors[0], \
            errors[0]
        assert errors[0].endswith("Rerun the same command to resume."), errors[0]
        assert took < 120, f"the run took {took:.0f} s to stop"
        return saved

    # this run's processes, and no other on the machine
    # The kill lands a moment after the checkpoint is committed: on a quiet machine the next step's update may be
    # over by then, and the death is met in the weight sync that follows it.
    first = stopped_with(lambda pid, placed: os.kill(placed["pids"]["actor"][1], signal.SIGKILL), 2,
                         "a worker of the actor died|a worker taking part in the weight sync died")
    second = stopped_with(lambda pid, placed: os.kill(placed["vllm_pids"][0], signal.SIGKILL), 2,
                          "vLLM engine died")
    saved = stopped_with(lambda pid, placed: os.kill(pid, signal.SIGTERM), 130, "interrupted at step ")
    assert first < second < saved

    # The rerun resumes; a reward function of a new user's (int() of a response that is no number) raises in its
    # first step, and the sentence names the function and the sample, and what survives, as the stops above do.
    strict = tmp_path / "strict_reward.py"
    strict.write_text("def reward_fn(prompts, responses, labels):\n"
                      "    return [float(int(r) == int(y)) for r, y in zip(responses, labels)]\n")
    argv[argv.index("--reward_fn") + 1] = f"{strict}:reward_fn"
    result = run_script("ppo_ray.py", argv, check=False)
    assert f"resumed from {checkpoints} at step {saved}" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith("error: reward function reward_fn raised ValueError: invalid literal for int"), errors
    assert "on sample 0 of the batch (prompt " in errors[0], errors[0]
    assert errors[0].endswith(f"The run stopped at step {saved + 1}; the checkpoint of step {saved} in {checkpoints} "
                              f"is intact. Rerun the same command to resume."), errors[0]
    steps = [m["step"] for m in metrics(out) if "objective/scores" in m]
    assert steps == list(range(1, saved + 1)), steps  # metrics continue; a stopped step is not kept
