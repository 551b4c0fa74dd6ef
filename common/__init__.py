"""Plumbing shared by the algorithm scripts; each module does one job and says which in its first line."""

import os

# DeepSpeed builds some ops (shm_comm, cpu_adam) on first use: cache them with the project, built once a machine.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache",
                                                           "torch_extensions"))

# torch deprecates the collective names DeepSpeed 0.19 calls on every ZeRO step; the warning would flood the logs.
import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
