"""Checkpoints that are never half-written: Hugging Face model exports and full training state that resumes exactly.

Everything is first written under a temporary name and renamed into place once complete, so a run killed at any
moment leaves either the previous checkpoint or the new one, never a partial one; one process (global rank 0)
does the renaming, after every rank has written. Training state is DeepSpeed's (model shards, optimizer,
scheduler) plus the caller's `client_state` (data position, KL controller, ...) and every rank's RNG state; the
last `keep_last` are kept. A write that fails (a full disk, a quota) stops every rank at once with the same
SaveFailed sentence, the previous checkpoint untouched and the failed one's files removed.
"""

import contextlib
import glob
import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from common import lora
from common.args import UserError
from common.data import merged_eos_ids
from common.logging_utils import phase

LATEST = "latest"


def replace_dir(tmp: str, final: str) -> None:
    """Move a complete directory into place, replacing an older one, with no moment where neither is whole."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


# What a Hugging Face model, tokenizer or adapter save writes: an earlier save's file of these that the new one lacks
# would be loaded with it (a chat_template.jinja, an adapter folder, a weights shard).
MODEL_FILES = ("adapter", "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
               "generation_config.json", "chat_template.jinja", "chat_template.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt")


def publish_model_files(tmp: str, out_dir: str) -> None:
    """Move a complete model folder's files into out_dir, which may also hold logs and checkpoints.

    config.json is what makes a folder loadable, so the old one goes first and the new one last: a run killed
    part-way leaves a folder that transformers refuses to load, never one that mixes two models. An earlier model's
    files (MODEL_FILES) that the new one does not replace go with the old config.json.
    """
    os.makedirs(out_dir, exist_ok=True)
    config = os.path.join(out_dir, "config.json")
    if os.path.exists(config):
        os.remove(config)
    fresh = set(os.listdir(tmp))
    for pattern in MODEL_FILES:
        for stale in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            if os.path.basename(stale) not in fresh:
                shutil.rmtree(stale) if os.path.isdir(stale) else os.remove(stale)
    names = sorted(fresh, key=lambda name: name == "config.json")
    for name in names:
        target = os.path.join(out_dir, name)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(os.path.join(tmp, name), target)
    os.rmdir(tmp)


def save_hf_model(model, tokenizer, out_dir: str, rank: int, extra_config: dict | None = None,
                  stop_ids: list[int] | None = None) -> None:
    """Save a model (gathered from ZeRO-3 shards) and its tokenizer into out_dir as a Hugging Face folder.

    Collective: every rank must call it. `extra_config` entries are stored in config.json (e.g. reward mean/std).
    `stop_ids` join generation_config's eos_token_id: the chat template's end-of-turn token a model was trained to
    end its turns with, where it is another token than the EOS (data.generation_stop_ids), so that transformers'
    generate and vLLM stop there too.
    A model with LoRA adapters is saved merged, as a plain model of its base class, and its adapter on its own in
    out_dir/adapter (loads with peft's PeftModel.from_pretrained on the starting model).
    """
    from common.deepspeed_utils import gathered_state_dict  # here: saving training state needs no DeepSpeed import

    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    state = gathered_state_dict(model, rank)
    failure = None
    if rank == 0:
        tmp = os.path.join(out_dir, ".model.tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            for key, value in (extra_config or {}).items():
                setattr(model.config, key, value)
            model.config.use_cache = True  # restored for inference (training turns it off)
            generation = getattr(model, "generation_config", None)
            if stop_ids and generation is not None:
                generation.eos_token_id = merged_eos_ids(generation.eos_token_id, tokenizer, stop_ids)
            if lora.is_lora(model):
                model.save_pretrained(os.path.join(tmp, "adapter"), state_dict=lora.adapter_state_dict(state))
                model, state = lora.base_model(model), lora.merged_state_dict(state, model)
            with lora.unquantized(model):  # QLoRA: the merged weights are dequantized
                model.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            publish_model_files(tmp, out_dir)
        except Exception as e:  # a full disk, a quota: said by every rank, none left waiting at a barrier
            failure = describe(e, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        failure = agree(failure)
    if failure:
        raise SaveFailed(f"could not write the model into {out_dir} ({failure}); make room there and rerun the same "
                         f"command (it resumes from the last checkpoint, if one was saved).")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class SaveFailed(UserError):
    """A checkpoint or model could not be written: a full disk, a quota, a folder that refuses writes."""


# How describe() ends a failure whose folder, or a file in it, was removed while the run wrote into it.
REMOVED = "a folder it wrote into was removed meanwhile"


def describe(error: Exception, folder: str | None = None) -> str:
    """An exception as a short clause: its type, the first line of its message and, with `folder`, the space left
    on the disk that holds it (torch.save reports a full disk as "unexpected pos 3480384 vs 3480272"). A file or
    folder that vanished mid-write is said to have been removed (REMOVED): the space left has nothing to do with it."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
    if isinstance(error, FileNotFoundError) or "does not exist" in text:  # (torch.save: "Parent directory ...")
        return f"{text.rstrip('.')}: {REMOVED}, by another process or a clean-up"
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return f"{text}; {shutil.disk_usage(folder).free / 2**20:,.0f} MiB free on its disk" if folder else text


def agree(failure: str | None) -> str | None:
    """The first rank's failure, if any rank failed, on every rank (collective): all raise the same error, so none
    waits for the others in a collective until the process group's timeout."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failure)
    failed = [(r, why) for r, why in enumerate(everyone) if why]
    if not failed:
        return None
    r, why = failed[0]
    return why if len(everyone) == 1 else f"rank {r}: {why}"


@contextlib.contextmanager
def write_failures_recorded(engines: dict):
    """Within, a DeepSpeed checkpoint write that fails is recorded in the yielded list instead of raising.

    DeepSpeed's save_checkpoint is collective and ends in a barrier: a rank whose write raised would leave the
    others there until the process group times out (30 minutes). Recorded, every rank goes through to the end and
    the ranks then agree on the outcome. After a failure the rank skips its remaining writes: the checkpoint is
    lost already. The writes are the checkpoint engine's save and makedirs, and the copy of DeepSpeed's recovery
    scripts, which it makes beside the checkpoint.
    """
    failures = []

    def recorded(write):
        def call(*args, **kwargs):
            if failures:
                return None
            try:
                return write(*args, **kwargs)
            except Exception as e:
                failures.append(e)
        return call

    patched = []  # (object, attribute, its own value before, or None where it had none: the class's method)
    for engine in engines.values():
        for owner, name in ((engine.checkpoint_engine, "save"), (engine.checkpoint_engine, "makedirs"),
                            (engine, "_copy_recovery_script")):
            patched.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, recorded(getattr(owner, name)))
    try:
        yield failures
    finally:
        for owner, name, before in reversed(patched):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def checkpoint_steps(ckpt_dir: str) -> list[int]:
    """Steps of the complete checkpoints in ckpt_dir, oldest first."""
    return sorted(int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(ckpt_dir, "step_*")) if p[-1].isdigit())


def saved_note(ckpt_dir: str) -> str:
    """What a stopped run leaves to resume from, as a clause: "the checkpoint of step 40 in DIR is intact"."""
    latest = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(latest):
        return "no checkpoint was saved"
    with open(latest) as f:
        step = f.read().strip().removeprefix("step_")
    return f"the checkpoint of step {step} in {ckpt_dir} is intact"


SETTINGS = "settings.json"


def check_settings(saved: dict | None, settings: dict, ckpt_dir: str) -> None:
    """Refuse to resume a run whose settings that fix the data order or the ZeRO partitioning (batch size, seed,
    number of ranks) differ from those it was saved with: it would silently train on other samples, or fail deep
    inside DeepSpeed. `settings` maps a flag (or a phrase) to its value; a checkpoint saved without any resumes."""
    changed = [k for k, v in settings.items() if saved and k in saved and saved[k] != v]
    if changed:
        k = changed[0]
        raise UserError(f"{ckpt_dir} holds a run made with {k} {saved[k]}, not {settings[k]}; rerun with {k} "
                        f"{saved[k]} to resume it, or give another --output_dir (or --ckpt_dir) to start anew.")


def run_settings(script: str, args, *flags: str) -> dict:
    """The settings (check_settings) that tell another run's checkpoint from this run's: the script, and the values
    of `flags` of `args` (which model, which data, which schedule). Without them a command pointed at a folder that
    held another run's checkpoints resumed that run, its weights, optimizer and step, and where that step was past
    this run's end, saved that run's model as its own."""
    return {"the script": os.path.basename(script), **{f"--{flag}": getattr(args, flag) for flag in flags}}


def check_not_past_end(ckpt_dir: str, total_steps: int) -> None:
    """Refuse to resume a checkpoint saved after more steps than this run has (--max_steps lowered): no step would
    run, and the model saved as this run's would be the checkpoint's. Raising it resumes and trains on."""
    latest = os.path.join(ckpt_dir, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read().strip().removeprefix("step_"))
        if step > total_steps:
            raise UserError(f"{ckpt_dir} holds a run at step {step}, past this run's end at step {total_steps}; raise "
                            f"--max_steps to {step} or more to resume it, or give another --output_dir (or --ckpt_dir) "
                            f"to start anew.")


def zero_layout(stage: int) -> str:
    """The ZeRO stages whose checkpoints load into each other, named for check_settings: 1 and 2 share one layout;
    0 and 3 have their own (DeepSpeed fails deep inside load_checkpoint across them)."""
    return "1 or 2" if stage in (1, 2) else str(stage)


def check_resume(ckpt_dir: str, settings: dict, step: int | None = None, keep_last: int = 1) -> None:
    """check_settings against the settings.json of the checkpoint a run in ckpt_dir would resume (the latest, or
    that of `step`); nothing to check when there is none. Also check_keep_last. Cheap: the trainers call it before
    loading a model."""
    check_keep_last(keep_last)
    saved = os.path.join(ckpt_dir, SETTINGS)
    if os.path.exists(saved) and (step is not None or os.path.exists(os.path.join(ckpt_dir, LATEST))):
        with open(saved) as f:
            check_settings(json.load(f), settings, ckpt_dir)


def save_train_state(engines: dict, ckpt_dir: str, step: int, client_state: dict, rank: int,
                     keep_last: int | None = 2, settings: dict | None = None) -> None:
    """Save every engine's DeepSpeed state + client_state + RNG as ckpt_dir/step_{step}, atomically, keeping the last
    `keep_last` (None: all, for a caller whose own commit comes later and prunes then). Collective.

    `engines` maps a name ("model", "critic", ...) to a DeepSpeed engine; each gets its own sub-folder. ckpt_dir
    must be one folder that every rank sees (a shared filesystem across nodes), as DeepSpeed's save_checkpoint
    assumes without its node-local storage option: there only global rank 0 creates folders and writes the model
    states. So global rank 0 alone clears leftovers and commits, after every rank has written; one committer per
    node would rename the same folder twice and fail, or move the fresh checkpoint aside as `.old`.
    """
    tag = f"step_{step}"
    partial = os.path.join(ckpt_dir, ".partial", tag)
    if rank == 0:  # leftovers of a run killed while saving
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    with write_failures_recorded(engines) as failures:
        for name, engine in engines.items():
            engine.save_checkpoint(os.path.join(partial, name), tag="state", client_state=client_state,
                                   save_latest=False)
    try:
        if not failures:
            os.makedirs(partial, exist_ok=True)
            torch.save(_rng_state(), os.path.join(partial, f"rng_rank{rank}.pt"))
    except Exception as e:
        failures.append(e)
    failure = agree(describe(failures[0], partial) if failures else None)  # also the barrier: all have written
    if not failure:
        check_shared(partial, ckpt_dir)
        if rank == 0:
            try:
                commit(partial, ckpt_dir, tag, keep_last, settings)
            except Exception as e:
                failure = describe(e, ckpt_dir)
        failure = agree(failure)
    if failure:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # the space it took is the user's again
        fix = "Find what removed it" if REMOVED in failure else "Make room there"
        raise SaveFailed(f"could not write the checkpoint of step {step} into {ckpt_dir} ({failure}); "
                         f"{saved_note(ckpt_dir)}. {fix} and rerun the same command to resume.")


def commit(partial: str, ckpt_dir: str, tag: str, keep_last: int | None, settings: dict | None) -> None:
    """Make the complete checkpoint in `partial` the latest (global rank 0 alone); then, unless keep_last is None,
    keep only the last `keep_last` (prune)."""
    if settings is not None:  # what a resumed run must match (check_settings)
        write_atomically(os.path.join(ckpt_dir, SETTINGS), json.dumps(settings, indent=1))
    replace_dir(partial, os.path.join(ckpt_dir, tag))
    write_atomically(os.path.join(ckpt_dir, LATEST), tag)
    if keep_last is not None:
        prune(ckpt_dir, int(tag.removeprefix("step_")), keep_last)


def prune(ckpt_dir: str, committed: int, keep_last: int) -> None:
    """Keep the last `keep_last` checkpoints up to the `committed` step, the one a rerun resumes from; drop the older
    ones and any of a later step, which a run stopped before committing it left (its step may never come again, and
    counting it would have dropped the committed one)."""
    steps = checkpoint_steps(ckpt_dir)
    kept = [s for s in steps if s <= committed][-keep_last:]
    for old in steps:
        if old not in kept:
            shutil.rmtree(os.path.join(ckpt_dir, f"step_{old}"), ignore_errors=True)


def check_keep_last(keep_last: int) -> None:
    """Refuse a --keep_last_checkpoints that would keep no checkpoint to resume from."""
    if keep_last < 1:
        raise UserError(f"--keep_last_checkpoints must be 1 or more (it keeps that many checkpoints), got "
                        f"{keep_last}.")


def write_atomically(path: str, text: str) -> None:
    """Write a file so that a reader sees the old text or the new, never part of one (a full disk included)."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")  # its space is the user's again
        raise


def check_shared(partial: str, ckpt_dir: str) -> None:
    """Every rank must see every rank's files in `partial`, or a checkpoint committed by rank 0 would lack the
    shards of ranks on other nodes. Collective: every rank raises the same error, so none waits at a barrier."""
    world = dist.get_world_size()
    missing = [r for r in range(world) if not os.path.exists(os.path.join(partial, f"rng_rank{r}.pt"))]
    everyone = [None] * world
    dist.all_gather_object(everyone, missing)
    blind = [r for r, seen in enumerate(everyone) if seen]
    if blind:
        raise UserError(f"{ckpt_dir} is not one folder shared by every node (rank {blind[0]} cannot see the files "
                        f"of rank(s) {everyone[blind[0]]}); put the checkpoint folder on a filesystem every node "
                        f"mounts at the same path.")


def load_train_state(engines: dict, ckpt_dir: str, rank: int, step: int | None = None,
                     settings: dict | None = None) -> dict | None:
    """Restore a checkpoint (the latest, or that of `step`) into the engines; return its client_state, or None.
    With `settings`, first refuse one saved with other settings (check_settings)."""
    latest = os.path.join(ckpt_dir, LATEST)
    if settings is not None:
        check_resume(ckpt_dir, settings, step)
    if step is not None:
        tag = f"step_{step}"
    elif not os.path.exists(latest):
        return None
    else:
        with open(latest) as f:
            tag = f.read().strip()
    client_state = None
    for name, engine in engines.items():
        path, client_state = engine.load_checkpoint(os.path.join(ckpt_dir, tag, name), tag="state",
                                                    load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"checkpoint {os.path.join(ckpt_dir, tag, name)} could not be loaded; "
                               f"delete {ckpt_dir} to start over.")
        follow_schedule(getattr(engine, "lr_scheduler", None))
    rng_file = os.path.join(ckpt_dir, tag, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def follow_schedule(schedule) -> None:
    """Give the next step the learning rate of this run's schedule at the restored step.

    The optimizer's saved state brings the rate the checkpoint's own schedule set for it. Where --max_steps changed
    (a run extended), the first resumed step took that old rate and the second the new schedule's: a step off both
    curves. Same schedule, same rate: then this changes nothing. (Stepping from one step back computes the rate of
    the restored step with this run's lambdas, which a LambdaLR does not save.)"""
    if schedule is None:
        return
    schedule.last_epoch -= 1
    schedule.step()


def checkpoint_dir(args) -> str:
    """Where a run's resumable checkpoints go: --ckpt_dir, else <output_dir>/checkpoints."""
    return args.ckpt_dir or os.path.join(args.output_dir, "checkpoints")


# ------------------------------------------------------------------------------ a trainer's bookkeeping, in order
def trainer_settings(script: str, args, world_size: int, run_flags) -> dict:
    """What a resumed run of sft/rm/dpo/kto must share with its checkpoint (check_settings): what fixes the data
    order and the ZeRO partitioning, and what makes it this run, the script's `run_flags` (model, data, schedule)."""
    return {"--train_batch_size": args.train_batch_size, "--seed": args.seed, "the number of ranks": world_size,
            "--zero_stage": zero_layout(args.zero_stage), **lora.settings(args),
            **run_settings(script, args, *run_flags)}


def resume(engines: dict, ckpt_dir: str, rank: int, settings: dict) -> int:
    """Load the latest checkpoint in ckpt_dir into the engines, if any (refusing one saved with other settings);
    returns the step to start at."""
    state = load_train_state(engines, ckpt_dir, rank, settings=settings) or {"step": 0}
    if state["step"] and rank == 0:
        print(f"resumed from {ckpt_dir} at step {state['step']}", flush=True)
    return state["step"]


# ------------------------------------------------------------------------- a Ray driver's checkpoint (ppo_ray.py)
# Each trained role saves its own DeepSpeed state under <ckpt_dir>/<role>; the driver's state file, written last, is
# what commits the step, so a run killed at any moment resumes from the last step whose file was written.
DRIVER_STATE = "driver_state.json"


def driver_state(ckpt_dir: str) -> dict | None:
    path = os.path.join(ckpt_dir, DRIVER_STATE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_driver_resume(ckpt_dir: str, settings: dict, max_steps: int) -> None:
    """Refuse, before anything starts, to resume a checkpoint saved with other settings or past --max_steps."""
    state = driver_state(ckpt_dir)
    if state is None:
        return
    check_settings(state.get("settings"), settings, ckpt_dir)
    if state["step"] > max_steps:  # no step would run, and the model saved would be the checkpoint's
        raise UserError(f"{ckpt_dir} holds a run at step {state['step']}, past this run's end at --max_steps "
                        f"{max_steps}; raise --max_steps to {state['step']} or more to resume it, or give another "
                        f"--output_dir (or --ckpt_dir) to start anew.")


def save_driver_checkpoint(ckpt_dir: str, groups: dict, step: int, state: dict, keep_last: int) -> None:
    """Every trained role's worker group (`groups`, by name) saves its state, then the driver's state file commits
    the step; only then are older checkpoints pruned."""
    with phase("checkpoint"):
        for name, group in groups.items():
            group.get(group.call("save_state", os.path.join(ckpt_dir, name), step))
    try:
        write_atomically(os.path.join(ckpt_dir, DRIVER_STATE), json.dumps({"step": step, **state}))
    except OSError as e:
        raise stopped(f"could not write the checkpoint ({describe(e, ckpt_dir)})", step - 1, ckpt_dir,
                      SaveFailed) from None
    for name in groups:  # a role's older step is what a stop before the line above resumes from
        prune(os.path.join(ckpt_dir, name), step, keep_last)


def load_driver_checkpoint(ckpt_dir: str, groups: dict) -> dict | None:
    """Load the latest committed step into every trained role's workers; returns the driver's state, or None."""
    import ray

    state = driver_state(ckpt_dir)
    if state is not None:
        ray.get([ref for name, group in groups.items() for ref in
                 group.call("load_state", os.path.join(ckpt_dir, name), state["step"])])
    return state


def stopped(why: str, step: int, ckpt_dir: str, error=UserError) -> UserError:
    """The sentence a driven run ends with when a worker or engine died or the user stopped it: where it was, and
    the last committed step (a checkpoint being written when it stopped is not committed)."""
    state = driver_state(ckpt_dir)
    done = state["step"] if state else None
    where = f"the checkpoint of step {done} in {ckpt_dir} is intact" if done else "no checkpoint was saved"
    return error(f"{why} at step {step + 1}; {where}. Rerun the same command to resume.")
