"""Per-request sampling parameters, shared by the engine, the verifier and the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_SEED = 2**63  # seeds travel as int64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed per request
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None, max_context: int | None = None) -> None:
        """Raise ValueError with a one-line message naming the first bad value. Without vocab_size or
        max_context (before a model is loaded), the checks that need them are skipped."""
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if max_context is not None and self.max_tokens > max_context:
            raise ValueError(f"max_tokens={self.max_tokens} exceeds the context length {max_context}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not (0 <= self.seed < _MAX_SEED):
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
