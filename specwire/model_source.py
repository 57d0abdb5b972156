"""What `--model` names, loaded: a checkpoint path (the default model when none is given) or a synthetic
shape (`synthetic:NAME`, random weights built on the device; see specwire.synthetic)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from specwire.config import ModelConfig
from specwire.default_model import resolve_model_path
from specwire.synthetic import synthetic_config, synthetic_shape, synthetic_tokenizer, synthetic_weights
from specwire.tokenizer import Tokenizer, load_tokenizer
from specwire.weights import load_checkpoint


def load_model(
    model: str | Path | None, device: torch.device, dtype: torch.dtype, names: Iterable[str] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str]:
    """(config, weights, tokenizer, display name) of a --model value. A checkpoint's weights are float32 host
    tensors; a synthetic model's are built on `device` in `dtype`. `names` keeps only those tensors."""
    if (shape := synthetic_shape(model)) is not None:
        config = synthetic_config(shape)
        weights = synthetic_weights(config, device, dtype, names)
        return config, weights, synthetic_tokenizer(config), str(model)
    path = resolve_model_path(model)
    config, weights = load_checkpoint(path)
    if names is not None:
        weights = {n: weights[n] for n in names if n in weights}
    return config, weights, load_tokenizer(path), path.name


def load_model_tokenizer(model: str | Path | None) -> Tokenizer:
    """The tokenizer of a --model value alone (no weights loaded)."""
    if (shape := synthetic_shape(model)) is not None:
        return synthetic_tokenizer(synthetic_config(shape))
    return load_tokenizer(resolve_model_path(model))
