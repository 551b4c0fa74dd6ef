"""One run per output folder: an OS file lock that a second run started on the same folder is refused by.

Two runs in one folder (a scheduler's requeue while the first still runs, a second terminal) both resume from the
same checkpoint, rotate each other's checkpoints away and interleave their lines in one metrics.jsonl. The lock is
flock(2) on a file in the folder: the kernel drops it when the process ends, however it ends, so a killed run never
leaves a stale lock behind. The file itself stays, naming the last run that held it.

    hold_output_folders(args.output_dir, checkpoint_dir(args))   # once, before the run writes anything
"""

import fcntl
import os
import socket
import time

from common.args import UserError

LOCK_FILE = ".run.lock"

_held = {}  # folder -> the open lock file; the lock lives as long as this process holds the file open


def hold_output_folders(*folders: str, rank: int = 0) -> None:
    """Lock each folder (created if missing) for this process, or refuse the run in one sentence naming the pid and
    host of the run that holds it. A folder inside another one given is covered by that one's lock. In a run of
    several ranks only the rank that writes the shared files (`rank` 0) takes it: the others are the same run."""
    if rank != 0:
        return
    folders = sorted({os.path.abspath(f) for f in folders if f})
    taken = []
    for folder in folders:
        if folder in _held or any(folder.startswith(other + os.sep) for other in folders):
            continue
        try:
            _held[folder] = _lock(folder)
        except UserError:
            for other in taken:  # the caller goes on without any of them (a test; a script ends here)
                _held.pop(other).close()
            raise
        taken.append(folder)


def _lock(folder: str):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not yet written its pid"
        handle.close()
        raise UserError(f"{folder} is in use by another run ({holder}), and two runs in one folder overwrite each "
                        f"other's checkpoints and logs; wait for that run to end or stop it, or give another "
                        f"--output_dir (or --ckpt_dir).") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    handle.flush()
    return handle


def release_output_folders() -> None:
    """Let go of every folder this process holds, as its end would: for a caller that runs a script's main in its
    own process and goes on (a test)."""
    while _held:
        _held.popitem()[1].close()  # closing the last descriptor of the file drops its lock
