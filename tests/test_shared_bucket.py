"""SharedBucket: the trainer's bucket buffer that a vLLM worker on the same host maps, tried between two processes."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from common.weight_sync import (SharedBucket, WeightSyncGroup, can_map_shared_bucket, map_shared_bucket, pack_buckets,
                                 split_bucket)

pytestmark = pytest.mark.skipif(not SharedBucket.supported(), reason="memfd and /proc are Linux's")

# Run in another process, as a vLLM worker would: map each handle given, report what it finds and then write into it.
READER = """
import json, sys
from common.weight_sync import can_map_shared_bucket, map_shared_bucket
mapped = {}
for line in sys.stdin:
    handle = json.loads(line)
    data = map_shared_bucket(mapped, handle)
    found = data[:8].tolist()
    data[8:16] = 7
    print(json.dumps({"found": found, "nbytes": data.numel(), "probe": can_map_shared_bucket(handle)}), flush=True)
"""


def test_another_process_sees_the_trainers_bytes_and_follows_the_bucket_when_it_grows():
    bucket = SharedBucket(64)
    reader = subprocess.Popen([sys.executable, "-c", READER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    try:
        def ask(handle):
            reader.stdin.write(json.dumps(handle) + "\n")
            reader.stdin.flush()
            return json.loads(reader.stdout.readline())

        floats = bucket.view(torch.float32, 4)  # 16 bytes, the first 4 floats of the buffer
        floats.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        probe = bucket.data[:8].tolist()
        reply = ask({**bucket.handle(), "probe": probe})
        assert reply == {"found": probe, "nbytes": 64, "probe": True}
        assert floats[2:].tolist() != [3.0, 4.0], "what the reader wrote did not reach this process: no memory shared"

        first = bucket.handle()
        grown = bucket.view(torch.float32, 100)  # 400 bytes: a new, larger file
        assert bucket.handle()["token"] != first["token"] and bucket.data.numel() == 400
        grown[:2] = torch.tensor([5.0, 6.0])
        reply = ask({**bucket.handle(), "probe": bucket.data[:8].tolist()})
        assert reply["nbytes"] == 400 and reply["found"] == bucket.data[:8].tolist() and reply["probe"]
    finally:
        reader.stdin.close()
        reader.wait(timeout=60)


def test_a_bucket_that_cannot_be_mapped_or_holds_other_bytes_is_refused():
    bucket = SharedBucket(64)
    bucket.data[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)
    assert can_map_shared_bucket({**bucket.handle(), "probe": [9, 8, 7, 6]})
    assert not can_map_shared_bucket({**bucket.handle(), "probe": [1, 2, 3, 4]})  # another process's fd, say
    missing = {**bucket.handle(), "shm": "/proc/self/fd/999999", "probe": [9, 8, 7, 6]}
    assert not can_map_shared_bucket(missing)


def test_a_mapping_is_kept_until_the_bucket_changes():
    bucket, mapped = SharedBucket(64), {}
    first = map_shared_bucket(mapped, bucket.handle())
    assert map_shared_bucket(mapped, bucket.handle()).data_ptr() == first.data_ptr()
    bucket.view(torch.uint8, 128)
    assert map_shared_bucket(mapped, bucket.handle()).numel() == 128


def test_a_file_that_is_not_a_bucket_is_never_mapped_nor_extended(tmp_path):
    """torch.from_file extends a file smaller than asked: a handle that names some other file must not get that far."""
    other = tmp_path / "some_file"
    other.write_bytes(b"abc")
    with open(other, "rb") as f:
        handle = {"shm": f"/proc/self/fd/{f.fileno()}", "nbytes": 4096, "token": "x", "probe": [97, 98, 99]}
        assert not can_map_shared_bucket(handle)
    assert other.read_bytes() == b"abc"


@pytest.mark.parametrize("staging", ["reused buffer", "shared memory"])
def test_packed_buckets_split_back_into_every_tensor_bit_for_bit(staging):
    """pack_buckets -> split_bucket, the trainer's and the worker's halves of a sync, with mixed dtypes, a tensor
    larger than a bucket (sent alone) and buckets that close early: every tensor arrives once, bit for bit. Each
    bucket is copied before the next is packed, as a worker does, since the buffer is reused."""
    torch.manual_seed(0)
    named = [("a", torch.randn(10)), ("b", torch.randn(3, 7)), ("c", torch.randn(5).bfloat16()),
             ("d", torch.randn(64)), ("e", torch.randn(2, 3)), ("f", torch.randint(0, 9, (4,)))]
    sync = WeightSyncGroup(None, "shm", SharedBucket(64)) if staging == "shared memory" else WeightSyncGroup(None)
    received, buckets = {}, 0
    for flat, meta in pack_buckets(named, sync, bucket_bytes=4 * 32):  # 32 float32 per bucket: "d" travels alone
        assert len({dtype for _, dtype, _ in meta}) == 1
        received.update(split_bucket(flat.clone(), meta))
        buckets += 1
    assert list(received) == [name for name, _ in named]
    for name, tensor in named:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert buckets == 5  # a+b | c | d | e | f
