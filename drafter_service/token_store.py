"""Ragged token-id lists with per-row columns in one .npz file (numpy arrays only, never pickled objects)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def save_token_lists(path: str | Path, token_lists: list[list[int]], **columns: np.ndarray) -> None:
    """token_lists as one flat array (uint16 when every id fits) plus offsets; columns one value per row
    (string columns are stored as fixed-width unicode, which needs no pickle)."""
    flat = [t for tokens in token_lists for t in tokens]
    dtype = np.uint16 if max(flat, default=0) < 2**16 else np.int32
    offsets = np.cumsum([0] + [len(tokens) for tokens in token_lists]).astype(np.int64)
    for name, col in columns.items():
        if len(col) != len(token_lists):
            raise ValueError(f"column {name!r} has {len(col)} rows, expected {len(token_lists)}")
    np.savez_compressed(path, tokens=np.asarray(flat, dtype=dtype), offsets=offsets, **columns)


def load_token_lists(path: str | Path) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """(token lists, columns) as save_token_lists wrote them."""
    with np.load(path, allow_pickle=False) as z:
        tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
        columns = {k: z[k] for k in z.files if k not in ("tokens", "offsets")}
    lists = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    return lists, columns
