"""Without CUDA, Triton kernels run in its interpreter. The variable must be set before triton is first
imported (transformers imports it too), so it is set here, before any test module loads.

transformers' own GGUF loader on the default model is the independent reference of several test modules;
it takes about 20 s (model) and 7 s (tokenizer) on 2 cores, so each is loaded once per session."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _default_gguf() -> Path:
    from specwire.default_model import default_model_path  # after TRITON_INTERPRET is set

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model() -> torch.nn.Module:
    """The default SmolLM2 GGUF as transformers loads it (fp32, eval). Shared: never move or cast it."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from transformers import AutoModelForCausalLM

    path = _default_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The default SmolLM2 GGUF's tokenizer and chat template as transformers converts them."""
    from transformers import AutoTokenizer

    path = _default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
