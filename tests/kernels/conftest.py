"""Kernel tests: on a GPU they run the real kernels; on a CPU only under
``TRITON_INTERPRET=1`` (``tests/test_kernels_interpreted.py`` runs them so)."""

import os

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore_glob = ["test_*.py"]
