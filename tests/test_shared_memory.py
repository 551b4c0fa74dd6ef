"""What a multi-rank CPU run leaves in /dev/shm: nothing, while DeepSpeed's shared-memory op keeps working."""

import glob
import os

import torch
import torch.multiprocessing as mp

from common.net import free_port


def _rank(rank: int, world_size: int, port: int, out: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed.comm

    from common.deepspeed_utils import init_distributed

    init_distributed()
    torch.distributed.barrier()  # both ranks are through init_distributed
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")
    summed = torch.full((4,), float(rank + 1))
    deepspeed.comm.inference_all_reduce(summed)  # through the op's shared-memory workspace, after the unlink
    if rank == 0:
        torch.save({"left": left, "summed": summed.tolist(),
                    "used_the_op": deepspeed.comm.comm.cdb.shm_comm_op is not None}, out)
    torch.distributed.barrier()


def test_a_two_rank_run_leaves_no_shared_memory_behind(tmp_path):
    out, port = str(tmp_path / "result.pt"), free_port()
    mp.spawn(_rank, args=(2, port, out), nprocs=2, join=True)
    result = torch.load(out)
    assert result["used_the_op"]  # else this test shows nothing
    assert result["left"] == [], result["left"]  # while both ranks still run
    assert result["summed"] == [3.0] * 4
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")
