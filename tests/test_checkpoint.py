"""save_train_state with two processes that are each local rank 0 of their node, as two Ray nodes' workers are.

On a shared filesystem (what launch/ and docs ask for across nodes) both see one checkpoint folder: exactly one of
them may commit it. With node-local folders the checkpoint could never be resumed whole, which must be said at once.
DeepSpeed is replaced by a stub engine that writes one shard file per rank, so the test needs only torch and gloo.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.net import free_port


class StubCheckpointEngine:
    """DeepSpeed's checkpoint engine: the object its save_checkpoint writes every file through."""

    def __init__(self, full: bool):
        self.full = full

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path):
        if self.full:  # what a full disk raises from torch.save
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        torch.save(state_dict, path)


class StubEngine:
    """The DeepSpeed engine as save_train_state uses it: save_checkpoint writes this rank's shard like ZeRO does,
    through its checkpoint engine, and ends in a barrier; rank 0 also copies the recovery scripts."""

    def __init__(self, rank: int, full: bool = False):
        self.rank = rank
        self.checkpoint_engine = StubCheckpointEngine(full)

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        folder = os.path.join(save_dir, tag)
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        time.sleep(0.05 * self.rank)  # the ranks finish at different times, as they do for real
        self.checkpoint_engine.save(client_state, os.path.join(folder, f"zero_rank{self.rank}.pt"))
        if self.rank == 0:
            self._copy_recovery_script(save_dir)
        dist.barrier()

    def _copy_recovery_script(self, folder):
        open(os.path.join(folder, "zero_to_fp32.py"), "w").close()


def save_steps(rank: int, world: int, port: int, dirs: list[str], steps: list[int], result_dir: str,
               full: tuple[int, int] | None = None) -> None:
    """One process: join a gloo world as local rank 0 of its own "node", save `steps`, write what happened.
    `full` = (rank, step): that rank's disk is full from that step on."""
    from common.checkpoint import save_train_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    outcome = "ok"
    try:
        for step in steps:
            engine = StubEngine(rank, full=full is not None and (rank, step) >= full and rank == full[0])
            save_train_state({"model": engine}, dirs[rank], step, {"step": step}, rank, keep_last=2)
    except Exception as e:  # reported to the test, which runs in another process
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    dist.destroy_process_group()


def run_two_nodes(dirs: list[str], steps: list[int], result_dir: str, full: tuple[int, int] | None = None
                  ) -> list[str]:
    mp.start_processes(save_steps, args=(2, free_port("127.0.0.1"), dirs, steps, result_dir, full), nprocs=2,
                       start_method="spawn")
    return [open(os.path.join(result_dir, f"rank{r}.txt")).read() for r in range(2)]


@pytest.mark.slow
def test_two_local_rank_zeros_on_shared_storage_commit_once(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    outcomes = run_two_nodes([ckpt, ckpt], [1, 2, 3], str(tmp_path))
    assert outcomes == ["ok", "ok"], outcomes
    assert sorted(os.listdir(ckpt)) == [".partial", "latest", "step_2", "step_3"]  # keep_last=2, nothing `.old`
    assert open(os.path.join(ckpt, "latest")).read() == "step_3"
    assert os.listdir(os.path.join(ckpt, ".partial")) == []
    for step in (2, 3):
        files = sorted(os.listdir(os.path.join(ckpt, f"step_{step}", "model", "state")))
        assert files == ["zero_rank0.pt", "zero_rank1.pt"], files  # both ranks' shards in the committed step
        assert torch.load(os.path.join(ckpt, f"step_{step}", "model", "state", "zero_rank1.pt")) == {"step": step}
        assert sorted(f for f in os.listdir(os.path.join(ckpt, f"step_{step}")) if f.startswith("rng")) == [
            "rng_rank0.pt", "rng_rank1.pt"]


@pytest.mark.slow
def test_node_local_checkpoint_folders_are_refused_in_one_sentence(tmp_path):
    dirs = [str(tmp_path / "node0" / "ckpt"), str(tmp_path / "node1" / "ckpt")]  # same path, different disks
    outcomes = run_two_nodes(dirs, [1], str(tmp_path))
    assert outcomes[0] == outcomes[1].replace(dirs[1], dirs[0]), outcomes  # every rank stops, none hangs
    assert outcomes[0].startswith("UserError: ") and "filesystem every node mounts" in outcomes[0], outcomes
    assert not os.path.exists(os.path.join(dirs[0], "step_1"))  # nothing half-shared was committed


@pytest.mark.slow
def test_a_write_that_fails_on_one_rank_stops_every_rank_with_one_sentence_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1's disk fills while it writes step 2: DeepSpeed's closing barrier would keep rank 0 waiting until the
    process group's timeout if rank 1 raised from inside save_checkpoint. Both ranks stop at once instead, with the
    same sentence, and step 1 stays the latest, whole."""
    ckpt = str(tmp_path / "ckpt")
    started = time.time()
    outcomes = run_two_nodes([ckpt, ckpt], [1, 2], str(tmp_path), full=(1, 2))
    assert time.time() - started < 120
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"SaveFailed: could not write the checkpoint of step 2 into {ckpt} (rank 1: "
                                  "RuntimeError: "), outcomes
    assert f"the checkpoint of step 1 in {ckpt} is intact. Make room there and rerun" in outcomes[0], outcomes
    assert open(os.path.join(ckpt, "latest")).read() == "step_1"
    assert sorted(os.listdir(ckpt)) == [".partial", "latest", "step_1"]
    assert os.listdir(os.path.join(ckpt, ".partial")) == []  # the failed step's files are gone, their space freed


def test_pruning_keeps_the_committed_step_and_those_before_it(tmp_path):
    """A run stopped after renaming step 20 into place but before writing `latest` left it uncommitted; the rerun,
    saving every 5 steps, commits step 15: counting step 20 among the last ones kept would have dropped step 15, the
    only one `latest` names. ppo_ray.py prunes each role's folder the same way once driver_state.json commits."""
    from common.args import UserError
    from common.checkpoint import check_keep_last, commit

    ckpt = str(tmp_path)
    for step in (5, 10, 20):
        os.makedirs(os.path.join(ckpt, f"step_{step}"))
    os.makedirs(os.path.join(ckpt, ".partial", "step_15"))
    commit(os.path.join(ckpt, ".partial", "step_15"), ckpt, "step_15", keep_last=2, settings=None)
    assert sorted(os.listdir(ckpt)) == [".partial", "latest", "step_10", "step_15"]
    os.makedirs(os.path.join(ckpt, ".partial", "step_25"))
    commit(os.path.join(ckpt, ".partial", "step_25"), ckpt, "step_25", keep_last=None, settings=None)
    assert sorted(os.listdir(ckpt)) == [".partial", "latest", "step_10", "step_15", "step_25"]  # left to the caller
    for keep_last in (0, -1):
        with pytest.raises(UserError, match=f"--keep_last_checkpoints must be 1 or more .*got {keep_last}"):
            check_keep_last(keep_last)


def test_a_model_saved_over_another_leaves_none_of_its_files_but_keeps_the_run_s_own(tmp_path):
    """A LoRA run's adapter folder, a chat template or a weights shard of an earlier model in the same --output_dir
    would be loaded with the new model; logs and checkpoints stay."""
    from common.checkpoint import publish_model_files

    out, tmp = tmp_path / "out", tmp_path / "out" / ".model.tmp"
    for stale in ("adapter/adapter_model.safetensors", "chat_template.jinja", "model-00001-of-00002.safetensors",
                  "model.safetensors.index.json", "config.json", "metrics.jsonl", "checkpoints/latest"):
        (out / stale).parent.mkdir(parents=True, exist_ok=True)
        (out / stale).write_text("old")
    tmp.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp / name).write_text("new")
    publish_model_files(str(tmp), str(out))
    assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "metrics.jsonl", "model.safetensors",
                                       "tokenizer.json"]
    assert (out / "config.json").read_text() == "new" and (out / "checkpoints" / "latest").read_text() == "old"
