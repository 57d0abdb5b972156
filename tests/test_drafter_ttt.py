"""Training-time test: the parallel unroll equals drafting step by step through the head's KV cache."""

import pytest
import torch
from specwire.drafter.eagle_head import EagleHead, EagleHeadConfig, shared_target_weights
from specwire.drafter.ttt import step_mask, unroll
from test_drafter_head import tiny_target

from specwire.model import KVCache, LlamaModel


def random_head(arch: str, seed: int = 3) -> EagleHead:
    config, sd = tiny_target()
    target = LlamaModel(config)
    target.load_weights(sd)
    head = EagleHead(
        EagleHeadConfig.for_target(config, arch, 40), shared_target_weights(target), torch.float32, "cpu", 64
    )
    head.init_weights(seed)
    with torch.no_grad():  # norms away from 1 so that a wrong norm shows
        for name, p in head.trainable_parameters().items():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return head


def draft_step_by_step(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, anchor: int, steps: int):
    """What the proposer does: prefill pairs 0..anchor with target features, then feed each draft step
    (the next token, the head's own last output) at the next position."""
    cache = KVCache.allocate(head.config.layer, 1, 64, torch.float32, "cpu")
    slot = torch.tensor([0], dtype=torch.int32)

    def run(start: int, n: int, f: torch.Tensor, own: bool) -> torch.Tensor:
        return head(
            ids[:, start : start + n],
            f,
            torch.tensor([start], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32),
            slot,
            cache.k[0],
            cache.v[0],
            own_features=own,
        )[:, -1:]

    outs = [run(0, anchor + 1, feats[:, : anchor + 1], False)]
    for j in range(1, steps):
        outs.append(run(anchor + j, 1, outs[-1], head.config.arch == "eagle3"))
    return outs


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_unroll_equals_step_by_step_drafting(arch):
    head = random_head(arch)
    g = torch.Generator().manual_seed(5)
    T, steps = 9, 4
    ids = torch.randint(0, head.config.target_vocab_size, (2, T), generator=g)
    feats = torch.randn(2, T, head.config.feature_dim, generator=g)
    with torch.no_grad():
        unrolled = unroll(head, ids, feats, steps)
        for row in range(2):
            for anchor in range(T - steps + 1):
                ref = draft_step_by_step(head, ids[row : row + 1], feats[row : row + 1], anchor, steps)
                for j in range(steps):
                    got = unrolled[j][row, anchor + j]
                    torch.testing.assert_close(got, ref[j][0, 0], atol=1e-5, rtol=1e-5)


def test_unroll_step_zero_is_the_plain_forward_and_later_steps_differ():
    head = random_head("eagle3")
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (1, 6), generator=g)
    feats = torch.randn(1, 6, head.config.feature_dim, generator=g)
    cache = KVCache.allocate(head.config.layer, 1, 64, torch.float32, "cpu")
    with torch.no_grad():
        plain = head(
            ids,
            feats,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([6], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            cache.k[0],
            cache.v[0],
        )
        outs = unroll(head, ids, feats, 3)
    torch.testing.assert_close(outs[0], plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outs[1][:, 1:], outs[0][:, 1:], atol=1e-3)  # self-fed steps see other inputs


def test_step_mask_needs_the_anchor_in_the_mask():
    mask = torch.tensor([[False, True, True, True, False]])
    assert step_mask(mask, 0).tolist() == mask.tolist()
    assert step_mask(mask, 1).tolist() == [[False, False, True, True, False]]
    assert step_mask(mask, 2).tolist() == [[False, False, False, True, False]]
