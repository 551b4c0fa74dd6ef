"""Turn an `Args` dataclass into a command line, using the string under each field as its --help text.

Scripts declare their flags CleanRL-style, a dataclass whose fields carry a one-line docstring:

    @dataclass
    class Args:
        lr: float = 1e-5
        \"\"\"peak learning rate\"\"\"

and call `args = parse_args(Args)`. Booleans take `--flag`, `--flag true` or `--flag false`; `Literal[...]`
fields become choices; `list[...]` fields take several values. `--local_rank`, which the deepspeed launcher
passes, is accepted and ignored (the rank comes from the environment).
"""

import argparse
import ast
import dataclasses
import inspect
import json
import os
import re
import signal
import sys
import textwrap
import time
import types
import typing


def check_model_path(path: str, flag: str = "--pretrain") -> None:
    """Fail early, in one sentence, on a model folder that is not there or holds no model. A path that could be a
    hub name ("org/name", as "out/sft" could) is left to the hub, which reports its own errors, unless the hub is
    offline (HF_HUB_OFFLINE) and its cache does not hold that name."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise UserError(f"{flag} {path} has no config.json; give a Hugging Face model folder.")
    elif not (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) and not path.startswith(".")):
        raise UserError(f"{flag} {path} does not exist; give a Hugging Face model folder or hub name.")
    elif os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise UserError(f"{flag} {path} does not exist, and no model of that name is in the Hugging Face cache "
                            f"(HF_HUB_OFFLINE is set); give a Hugging Face model folder.")
    file = config_file(path)
    if file is not None:
        check_weight_files(os.path.dirname(file), path, flag)


def check_weight_files(folder: str, path: str, flag: str) -> None:
    """Refuse a model folder whose weights an interrupted download left damaged: a *.safetensors file shorter or
    longer than its header says (safetensors' own error is "incomplete metadata, file not fully covered", from
    deep inside the model load, on every rank), or a shard that model.safetensors.index.json names and the folder
    lacks. Reads the headers only (safetensors format: an 8-byte little-endian header length, a JSON header giving
    each tensor's data_offsets, then the data)."""
    names = sorted(os.listdir(folder))
    for index in (n for n in names if n.endswith(".index.json")):
        try:
            with open(os.path.join(folder, index)) as f:
                shards = sorted(set((json.load(f).get("weight_map") or {}).values()))
        except (OSError, ValueError, AttributeError):
            raise UserError(f"{flag} {path}: {index} is damaged (not a JSON weight index); fetch the model "
                            f"again.") from None
        for shard in shards:
            if not os.path.isfile(os.path.join(folder, shard)):
                raise UserError(f"{flag} {path}: {shard}, a shard its {index} names, is missing, as an interrupted "
                                f"download leaves it; fetch that file again.")
    for name in (n for n in names if n.endswith(".safetensors")):
        if not os.path.isfile(os.path.join(folder, name)):
            raise UserError(f"{flag} {path}: {name} is a link to a file that is not there; fetch that file again.")
        size, expected = os.path.getsize(os.path.join(folder, name)), None
        try:
            with open(os.path.join(folder, name), "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if 8 + header_len <= size:
                    header = json.loads(f.read(header_len))
                    expected = 8 + header_len + max((t["data_offsets"][1] for k, t in header.items()
                                                     if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            pass  # not a safetensors header: cut inside it, or another kind of file
        if expected != size:
            what = f"{size:,} bytes where its header says {expected:,}" if expected else "its header is unreadable"
            raise UserError(f"{flag} {path}: {name} is damaged ({what}), as an interrupted download leaves it; "
                            f"fetch that file again.")


# Heads whose checkpoints load as a causal LM only with a new, random output layer (a reward model saved by rm.py).
NOT_LM_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def check_causal_lm(path: str, flag: str = "--pretrain") -> None:
    """Refuse, from its config.json, a model transformers cannot load as a causal LM, or would load with a new,
    untrained LM head and train on silently (a reward model where the policy belongs)."""
    config = check_decoder_only(path, flag)
    architectures = (config or {}).get("architectures") or []
    if architectures and all(a.endswith(NOT_LM_HEADS) for a in architectures):
        raise UserError(f"{flag} {path} is a {architectures[0]}, not a causal language model: loaded as one it would "
                        f"get a new, untrained output layer. Give the policy's folder (a reward model belongs to "
                        f"--reward_pretrain).")


def config_file(path: str) -> str | None:
    """The config.json of the model `path` names: in its folder, or for a hub name the copy in the local hub cache
    (never downloaded here); None when there is neither, and the checks that read it leave the model to
    transformers."""
    local = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(local):
        return local
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(path, "config.json")
    except ValueError:  # not a valid hub name either (huggingface_hub's HFValidationError)
        return None
    return cached if isinstance(cached, str) else None


def check_decoder_only(path: str, flag: str = "--pretrain") -> dict | None:
    """Refuse, from its config.json, a model that is not a decoder-only transformer (T5, BERT, DeBERTa, ...): a
    policy must generate, and a reward model's or critic's score is read at a sequence's last token, which only a
    causal model's last hidden state summarises. Returns the config, None for a hub name or remote code."""
    file = config_file(path)
    if file is None:
        return None  # a hub name not in the cache: transformers reports its own errors
    with open(file) as f:
        config = json.load(f)
    if {"AutoModelForCausalLM", "AutoModelForSequenceClassification"} & set(config.get("auto_map") or {}):
        return None  # the model's own code (trust_remote_code) says how it loads
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{flag} {path} is a {model_type!r} model, which transformers cannot load as a causal "
                        f"language model; give a decoder-only model (Llama, Qwen2, Mistral, ...).")
    return config


# Model types whose forward lets the sequences of a packed row attend to each other: with no attention_mask,
# transformers cuts a row where its position_ids restart only for models that build their attention mask from them
# (Llama, Qwen2/3, Mistral, Gemma, Phi, GPT-2, GPT-NeoX, OLMo and most recent ones). These read the row as one
# sequence, measured on tiny random models of transformers 5.19 (tests/test_packing.py measures them again): a packed
# sequence's last hidden state moved by 2-72% of its size. The recurrent ones (the Mambas, RWKV, RecurrentGemma)
# also carry their state from one sequence into the next.
PACKING_IGNORED = ("opt", "falcon", "bloom", "mpt", "xglm", "biogpt", "minimax", "mamba", "mamba2", "falcon_mamba",
                   "recurrent_gemma", "rwkv")


def check_packing(path: str, flag: str = "--pretrain", cuda: bool | None = None,
                  attention: str | None = None, option: str = "--packing_samples") -> None:
    """Refuse --packing_samples for a model whose samples would attend to each other in a packed row, silently
    mixing every packed loss (PACKING_IGNORED), from its config.json; and on a CUDA GPU where it would be slower
    (check_packing_attention). `cuda` and `attention` default to what this process sees and would load with."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda and attention is None:
        from common.deepspeed_utils import attention_implementation, use_bf16

        attention = attention_implementation(torch.bfloat16 if use_bf16() else torch.float32)
    check_packing_attention(cuda, attention)
    file = config_file(path)
    if file is None:
        return
    with open(file) as f:
        model_type = json.load(f).get("model_type")
    if model_type in PACKING_IGNORED:
        raise UserError(f"{flag} {path} is a {model_type!r} model, whose attention does not restart at each "
                        f"sequence of a packed row: its packed samples would attend to each other. Leave out "
                        f"{option}.")


def check_packing_attention(cuda: bool, attention: str | None) -> None:
    """Refuse --packing_samples on a CUDA GPU whose models would not run flash-attention 2. transformers 5.19's sdpa
    and eager paths turn a packed row's restarting position_ids into a dense (total, total) mask
    (masking_utils.find_packed_sequence_indices, packed_sequence_mask_function): 8 x 2k tokens cost a 16k x 16k mask
    and its attention, more than the padding packing saves. flash-attention's varlen kernels take each sequence's
    bounds instead (modeling_flash_attention_utils). On CPU packing is left to the user (the tests pack tiny rows)."""
    if cuda and attention != "flash_attention_2":
        raise UserError(f"--packing_samples on a CUDA GPU needs flash-attention 2, and the models would load with "
                        f"{attention}, for which transformers masks a packed row with one dense (tokens x tokens) "
                        f"mask that costs more than the padding it saves; install flash-attn (pip install flash-attn "
                        f"--no-build-isolation; bf16 GPUs, Ampere or later) or leave out --packing_samples.")


def check_output_dir(path: str, flag: str = "--output_dir") -> None:
    """Refuse an output folder that is a file, or that this user cannot create or write, before any work is done."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file; give a folder (it is created if missing).")
    existing = path
    while existing and not os.path.exists(existing):  # the nearest folder that exists is the one written into
        existing = os.path.dirname(existing.rstrip(os.sep))
    existing = existing or "."
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path} is inside {existing}, which is a file; give a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} cannot be written: {os.path.abspath(existing)} is not writable by this user; "
                        f"give a folder you can write to.")


# config.json keys that bound a model's sequence length; vLLM takes the smallest one present (vllm/config/model.py).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len", "model_max_length")
# RoPE scaling types whose max_position_embeddings already is the stretched length; others multiply it by "factor".
STRETCHED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_max_len(path: str) -> int | None:
    """The longest sequence the model `path` takes, derived from its config.json (config_file) as vLLM derives it
    (the smallest position key, stretched by a RoPE scaling factor, capped by the tokenizer's model_max_length), or
    None when there is no config.json here or it names no length."""
    file = config_file(path)
    if file is None:
        return None
    with open(file) as f:
        config = json.load(f)
    config = config.get("text_config") or config  # multimodal configs keep the language model's apart
    lengths = [config[k] for k in POSITION_KEYS if isinstance(config.get(k), int) and config[k] > 0]
    if not lengths:
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if (rope.get("rope_type") or rope.get("type")) in STRETCHED_ROPE_TYPES or not isinstance(factor, (int, float)):
        factor = 1
    limit = int(min(lengths) * factor)
    tokenizer_config = os.path.join(os.path.dirname(file), "tokenizer_config.json")  # (a cached snapshot's too)
    if os.path.isfile(tokenizer_config):
        with open(tokenizer_config) as f:
            tokenizer_max = json.load(f).get("model_max_length")
        if isinstance(tokenizer_max, int) and 0 < tokenizer_max < limit:
            limit = tokenizer_max
    return limit


def check_lengths(path: str, what: str, tokens: int, fix: str, flag: str = "--pretrain") -> None:
    """Refuse, before anything loads, a sequence length (`what`, e.g. "--max_len") beyond what the model `path`
    takes: a vLLM engine would stop with a long traceback, a trainer would index positions the model lacks."""
    limit = model_max_len(path)
    if limit is not None and tokens > limit:
        raise UserError(f"{what} is {tokens} tokens, more than {flag} {path} takes ({limit}, from its config.json); "
                        f"lower {fix}.")


def field_docs(cls) -> dict[str, str]:
    """Map each field of a dataclass to the string literal written right under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


def build_parser(cls, description: str | None = None) -> argparse.ArgumentParser:
    # No abbreviations: with flags that share prefixes, a misspelt one (--max_step) would silently set another.
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue  # computed at run time
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = {"default": default, "help": f"{docs.get(f.name, '')} (default: {default})"}
        if tp is bool:
            kwargs.update(type=_to_bool, nargs="?", const=True, metavar="BOOL")
        elif typing.get_origin(tp) is typing.Literal:
            kwargs.update(choices=typing.get_args(tp), type=type(typing.get_args(tp)[0]))
        elif typing.get_origin(tp) is list:
            kwargs.update(nargs="+", type=typing.get_args(tp)[0])
        else:
            kwargs.update(type=tp)
        parser.add_argument(f"--{f.name}", **kwargs)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return parser


_positive = (lambda v: 0 < v < float("inf"), "a positive number")
_fraction = (lambda v: 0 <= v <= 1, "between 0 and 1")
_at_least_0 = (lambda v: v >= 0, "0 or more")
_at_least_1 = (lambda v: v >= 1, "1 or more")
# Flags whose values outside these ranges no run means, in whichever script has them: a negative --min_lr_ratio
# made the schedule's tail gradient ascent, a --max_epochs of 0 saved the untrained model as the result, a
# --logging_steps of 0 divided by zero. NaN is in none of them.
RANGES = {"learning_rate": _positive, "actor_learning_rate": _positive, "critic_learning_rate": _positive,
          "warmup_ratio": _fraction, "min_lr_ratio": _fraction, "weight_decay": _at_least_0, "grad_clip": _at_least_0,
          "max_steps": _at_least_0, "eval_steps": _at_least_0, "save_steps": _at_least_0, "max_epochs": _at_least_1,
          "train_batch_size": _at_least_1, "micro_train_batch_size": _at_least_1, "logging_steps": _at_least_1,
          "rollout_batch_size": _at_least_1, "n_samples_per_prompt": _at_least_1,
          "micro_rollout_batch_size": _at_least_1, "reward_timeout": _at_least_0}


def parse_args(cls, argv: list[str] | None = None):
    """Parse the command line (or `argv`) into an instance of the dataclass `cls`; a value outside its RANGES is
    argparse's error (usage, one line, exit code 2)."""
    description = inspect.getmodule(cls).__doc__ if inspect.getmodule(cls) else None
    parser = build_parser(cls, description)
    namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
    values = {k: v for k, v in vars(namespace).items() if k != "local_rank"}
    for name, (allowed, what) in RANGES.items():
        if values.get(name) is not None and not allowed(values[name]):
            parser.error(f"--{name} {values[name]} must be {what}.")
    return cls(**values)


class UserError(ValueError):
    """A mistake in the user's flags, files or data; its message says what to change."""


class Interrupted(UserError):
    """Ctrl-C or SIGTERM stopped the run; the message says where, and what survives (exit code 130, as a shell
    reports a Ctrl-C)."""

    exit_code = 130


_stopping = False  # a Ctrl-C or SIGTERM has been raised as KeyboardInterrupt


def _raise_keyboard_interrupt(signum, frame):
    """The first Ctrl-C or SIGTERM becomes a KeyboardInterrupt; later ones are ignored. Stops come in pairs: Ctrl-C
    under `deepspeed --num_gpus N` reaches every rank, and the launcher then sends its own, which used to land while
    run_main was naming the surviving checkpoint and cut that short with a second traceback."""
    global _stopping
    if not _stopping:
        _stopping = True
        raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """Make SIGTERM (a scheduler's or `kill`'s stop) end the run as Ctrl-C does, through run_main's sentence, and
    either of them do so once (_raise_keyboard_interrupt).

    run_main calls it; call it again after ray.init(), whose driver installs a handler that aborts the process, and
    after ray.shutdown(), which leaves SIGTERM at its default in the C library, where Python does not see it."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)


def run_main(main, args, saved=None) -> None:
    """Run main(args); a mistake in the user's flags or data ends the run with one sentence and exit code 2.

    Ctrl-C and SIGTERM (a scheduler's stop) end it with one sentence too, exit code 130: "interrupted; the
    checkpoint of step 40 in DIR is intact. Rerun the same command to resume.", where `saved(args)` names what
    survives (e.g. checkpoint.saved_note). Every rank hits the same mistake, so only rank 0 prints it. Anything else
    keeps its full traceback. A process in a torch.distributed group leaves through os._exit (exit_if_distributed
    says why).
    """
    if not sys.stderr.isatty():  # in a log file, the "Loading weights" bars' redraws are noise
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    stop_on_sigterm()
    try:
        try:
            main(args)
        except UserError:
            raise
        except Exception:
            if _stopped_meanwhile():  # a peer's stop broke a collective before this rank's own stop was handled
                raise KeyboardInterrupt from None
            raise
    except UserError as e:
        _stop(str(e), getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        where = saved(args) if saved else None
        _stop(f"interrupted; {where}. Rerun the same command to resume." if where else "interrupted.", 130)
    exit_if_distributed(0)


def _stopped_meanwhile() -> bool:
    """Whether the error that ended this process follows a Ctrl-C or SIGTERM that has reached it too.

    Ctrl-C reaches every rank at once, but a rank blocked in a collective runs Python's handler only once the
    collective returns, and it returns with an error ("Connection reset by peer") when a peer that handled its stop
    first has already exited. The signal is then pending here, and a short sleep lets its handler run. A process
    outside a torch.distributed group has no peers, and does not wait."""
    if _stopping:
        return True
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    try:
        time.sleep(2)
    except KeyboardInterrupt:
        return True
    return _stopping


def _stop(message: str, exit_code: int) -> None:
    """Print `message` as the run's last line, "error: ...", and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tqdm import tqdm

    for bar in list(tqdm._instances):  # end any progress bar's line, so the error starts a line of its own
        bar.close()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # joins Ray's threads that print worker deaths, so that none writes into the error's line
    sys.stdout.flush()
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"error: {message}\n")  # one write: a line no other thread can split
        sys.stderr.flush()
    exit_if_distributed(exit_code)
    sys.exit(exit_code)


def exit_if_distributed(exit_code: int) -> None:
    """End a process that is in a torch.distributed group (a trainer, even with one rank) with os._exit, once its
    output is flushed; return in any other.

    The interpreter's own exit is not safe there. Gloo has no shutdown: its worker threads live until the group is
    freed, which DeepSpeed's engine delays to the interpreter's final garbage collection. A thread still releasing
    a finished collective's tensors then needs the GIL, which a finalising interpreter no longer hands out, and the
    C++ runtime aborts the process: exit code -6 ("terminate called without an active exception") after every
    file was written, now and then, more often on a busy machine. multiprocessing ends its children the same way.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)  # what its exit hook would have done
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # a Ray this process started would otherwise outlive it
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
