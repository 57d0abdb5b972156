"""Triton's Philox4x32-10 and its uniform floats, bit for bit, in plain PyTorch.

Triton's `tl.philox(seed, c0, c1, c2, c3)` keys the generator with the 64-bit seed (low word, high word) and
returns four 32-bit words per counter; `tl.uint_to_uniform_float` maps each word to a float32 in [0, 1).
Here the same arithmetic runs on int64 tensors masked to 32 bits, so a CPU reference draws exactly the
uniforms a kernel draws: one counter gives four uniforms.
"""

import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
# Triton's scale: the largest float32 with (2**31 - 1) * scale < 1.
_UNIFORM_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * b for a < 2**32 (int64 tensor) and b < 2**32, without overflow."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    t_lo, t_hi = a * b_lo, a * b_hi  # each < 2**48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (t_lo + ((t_hi & 0xFFFF) << 16)) & _MASK32
    return hi, lo


def philox4x32(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
    rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four uint32 words (as int64) per counter; arguments broadcast against each other."""
    seed = seed.long()
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2, c3 = (c.long() & _MASK32 for c in (c0, c1, c2, c3))
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def uint_to_uniform(word: torch.Tensor) -> torch.Tensor:
    """Triton's uint_to_uniform_float for 32-bit words: read as int32, fold negatives with ~x, scale."""
    folded = torch.where(word >= 2**31, _MASK32 - word, word)
    return folded.to(torch.float32) * _UNIFORM_SCALE.to(word.device)


def philox_uniforms(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
) -> torch.Tensor:
    """Uniforms [..., 4]: the four float32 draws of each counter, in Triton's output order."""
    return torch.stack([uint_to_uniform(w) for w in philox4x32(seed, c0, c1, c2, c3)], dim=-1)
