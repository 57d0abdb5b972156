"""Training-time test (EAGLE-3): the head unrolled over its own outputs for several draft steps at once.

Index s of step j is the j-th draft after anchor i = s - j: its token is the sequence's token s + 1 (the
draft that was accepted, teacher forced), its feature the head's own step-(j - 1) output at index s - 1,
and its target the same next-token distribution as step 0's index s. It attends to what drafting would
have in its cache: the target-fed entries 0..i of step 0, then the one entry at s - j + m of each step
m = 1..j (the earlier drafts of the same anchor). All anchors run in parallel; a step costs one forward.
"""

from __future__ import annotations

import torch
from specwire.drafter.eagle_head import EagleHead
from specwire.kernels import ops


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """x at index s - n along dim (indices below n wrap around: no step reads them)."""
    return torch.roll(x, n, dims=dim) if n else x


def _attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Step j = len(keys) - 1: q [B, T, Hq, D] over step 0's keys 0..s - j and step m's key at s - j + m."""
    j, T = len(keys) - 1, q.shape[1]
    rep = q.shape[2] // keys[0].shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, Hkv, D] -> [B, Hq, T, D]
        return x.repeat_interleave(rep, 2).transpose(1, 2)

    qh = q.transpose(1, 2)
    k0, v0 = heads(keys[0]), heads(values[0])
    scores = (qh @ k0.transpose(-1, -2)).float() * scale  # [B, Hq, T, T]
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-j)
    scores = [scores.masked_fill(~allowed, float("-inf"))]
    later = [
        (_shift(heads(k), j - m, 2), _shift(heads(v), j - m, 2))
        for m, (k, v) in enumerate(zip(keys[1:], values[1:], strict=True), start=1)
    ]
    scores += [((qh * k).sum(-1).float() * scale)[..., None] for k, _ in later]
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)
    out = probs[..., :T] @ v0
    for m, (_, v) in enumerate(later):
        out = out + probs[..., T + m, None] * v
    return out.transpose(1, 2)


def unroll(
    head: EagleHead, input_ids: torch.Tensor, features: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The head's outputs [B, T, H] at draft steps 0..steps - 1 for tokens [B, T] (token t + 1) and target
    features [B, T, F] (of t), every row from position 0. Differentiable with SPECWIRE_TORCH_OPS=1."""
    attn = head.layer.self_attn
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    feats, own = features, False
    for _ in range(steps):
        attn_in, residual = head.attention_input(input_ids, feats, own_features=own)
        q, k, v = attn.qkv_proj(attn_in).split(attn.split_sizes, dim=-1)
        q = q.unflatten(-1, (attn.num_heads, attn.head_dim))
        k = k.unflatten(-1, (attn.num_kv_heads, attn.head_dim))
        q, k = ops.rope(q, k, positions, head.cos_sin)
        keys.append(k)
        values.append(v.unflatten(-1, (attn.num_kv_heads, attn.head_dim)))
        out = _attention(q, keys, values, attn.scale)
        outputs.append(head.finish(attn.o_proj(out.flatten(-2)), residual))
        feats, own = _shift(outputs[-1], 1, 1), head.config.arch == "eagle3"
    return outputs


def step_mask(mask: torch.Tensor, step: int) -> torch.Tensor:
    """Where step `step` is scored: index s and its anchor s - step both in `mask` [B, T] (bool)."""
    if step == 0:
        return mask
    anchored = torch.zeros_like(mask)
    anchored[:, step:] = mask[:, :-step]
    return mask & anchored
