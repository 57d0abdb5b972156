"""Without CUDA, Triton kernels run in its interpreter. The variable must be set before triton is first
imported (transformers imports it too), so it is set here, before any test module loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
