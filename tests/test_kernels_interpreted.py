"""Run tests/kernels under the Triton interpreter (CPU): the kernels' own code, not
their references, against the references."""

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/kernels run the real kernels")
def test_kernels_under_the_triton_interpreter():
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           os.path.join(here, "kernels")], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
