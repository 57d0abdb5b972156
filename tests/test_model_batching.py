"""Batched, padded, slot-scattered forwards equal feeding each request alone, one token at a time."""

import pytest
import torch

from specwire.config import ModelConfig
from specwire.model import KVCache, LlamaModel
from specwire.weights import checkpoint_shapes

CONFIG = ModelConfig(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
    tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_ids=(),
)
NUM_SLOTS, MAX_CONTEXT = 4, 32
TOL = dict(rtol=1e-5, atol=1e-5)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def build_model(device: str, dtype: torch.dtype = torch.float32) -> LlamaModel:
    gen = torch.Generator().manual_seed(0)
    m = LlamaModel(CONFIG, dtype, device)
    m.load_weights({
        name: (1.0 if len(shape) == 1 and "norm" in name else 0.0) + 0.15 * torch.randn(shape, generator=gen)
        for name, shape in checkpoint_shapes(m.config).items()
    })
    return m


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def model(request) -> LlamaModel:
    return build_model(request.param)


def new_cache(model: LlamaModel, num_slots: int = NUM_SLOTS) -> KVCache:
    return KVCache.allocate(CONFIG, num_slots, MAX_CONTEXT, model.dtype, model.device)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_by_one(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The reference: one request alone in its own cache, one token per forward. Logits [len(ids), V]."""
    cache = new_cache(model, num_slots=1)
    rows = [Step([(0, pos, [t])]).run(model, cache)[0][0] for pos, t in enumerate(ids)]
    return torch.stack(rows)


class Step:
    """One padded batched forward: rows of (slot, start_pos, new tokens); pad ids are random garbage."""

    def __init__(self, rows: list[tuple[int, int, list[int]]], seed: int = 0):
        self.rows = rows
        T = max(1, *(len(ids) for _, _, ids in rows))
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, CONFIG.vocab_size, (len(rows), T), generator=gen)
        for b, (_, _, ids) in enumerate(rows):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self.input_ids = input_ids
        self.start_pos = torch.tensor([p for _, p, _ in rows], dtype=torch.int32)
        self.num_tokens = torch.tensor([len(ids) for _, _, ids in rows], dtype=torch.int32)
        self.slots = torch.tensor([s for s, _, _ in rows], dtype=torch.int32)
        live = [b * T + i for b, (_, _, ids) in enumerate(rows) for i in range(len(ids))]
        self.logits_index = torch.tensor(live)

    def inputs(self, device: torch.device) -> list[torch.Tensor]:
        """[input_ids, start_pos, num_tokens, slots] on device."""
        return [t.to(device) for t in (self.input_ids, self.start_pos, self.num_tokens, self.slots)]

    def check_writes(self, cache: KVCache, before_k: torch.Tensor, before_v: torch.Tensor) -> None:
        """The cache changed only where live tokens were written (and in the trash slot)."""
        written = torch.zeros(cache.num_slots + 1, cache.max_context, dtype=torch.bool)
        written[cache.trash_slot] = True
        for slot, start, ids in self.rows:
            written[slot, start : start + len(ids)] = True
        for before, after in ((before_k, cache.k), (before_v, cache.v)):
            unchanged = (before == after).all(dim=-1).all(dim=2).all(dim=0).cpu()  # [slots + 1, context]
            assert unchanged[~written].all(), "a padded token or row wrote outside the trash slot"

    def run(self, model: LlamaModel, cache: KVCache) -> list[torch.Tensor]:
        """Runs the step and checks its cache writes; returns float32 logits per row [num_tokens[b], V]."""
        before_k, before_v = cache.k.clone(), cache.v.clone()
        out = model(*self.inputs(model.device), cache, self.logits_index.to(model.device))
        assert out.logits.dtype == torch.float32
        assert out.logits.shape == (len(self.logits_index), CONFIG.vocab_size)
        self.check_writes(cache, before_k, before_v)
        return list(out.logits.split([len(ids) for _, _, ids in self.rows]))


def test_batched_prefill_then_verify_matches_one_by_one(model):
    prompts = [tokens(5, 1), tokens(9, 2), tokens(2, 3)]
    drafts = [tokens(4, 4), tokens(2, 5), []]  # verify feeds 1 + k_i tokens: k = 3, 1 and an idle row
    slots = [3, 0, 2]  # non-contiguous; slot 1 stays empty
    cache = new_cache(model)

    prefill = Step([(s, 0, p) for s, p in zip(slots, prompts, strict=True)], seed=10).run(model, cache)
    verify = Step([(s, len(p), d) for s, p, d in zip(slots, prompts, drafts, strict=True)], seed=11)
    verify = verify.run(model, cache)

    for b in range(3):
        ref = one_by_one(model, prompts[b] + drafts[b])
        torch.testing.assert_close(prefill[b], ref[: len(prompts[b])], **TOL)
        torch.testing.assert_close(verify[b], ref[len(prompts[b]) :], **TOL)


def test_logits_index_none_returns_every_position(model):
    step = Step([(1, 0, tokens(3, 6)), (NUM_SLOTS, 0, [])], seed=12)
    cache = new_cache(model)
    out = model(*step.inputs(model.device), cache)
    assert out.logits.shape == (2 * 3, CONFIG.vocab_size)
    assert out.hidden.shape == (2, 3, CONFIG.hidden_size)
    assert out.aux_hidden is None
    assert torch.isfinite(out.logits).all()  # the padded row is finite garbage
    torch.testing.assert_close(out.logits[:3], one_by_one(model, tokens(3, 6)), **TOL)


def test_freed_slot_reused_by_new_request_and_trash_row(model):
    a, old, new = tokens(6, 7), tokens(12, 8), tokens(3, 9)
    cache = new_cache(model)
    Step([(2, 0, a), (0, 0, old)], seed=13).run(model, cache)
    # `old` leaves; `new` takes slot 0, whose positions 3..11 still hold old keys that must stay invisible.
    # The third row is a CUDA-graph style pad row on the trash slot with garbage ids and position.
    a_next, new_next = tokens(1, 10), tokens(2, 11)
    step = Step([(0, 0, new), (2, len(a), a_next), (NUM_SLOTS, 7, [])], seed=14)
    new_logits, a_logits, pad_logits = step.run(model, cache)
    assert pad_logits.numel() == 0
    torch.testing.assert_close(new_logits, one_by_one(model, new), **TOL)
    torch.testing.assert_close(a_logits, one_by_one(model, a + a_next)[len(a) :], **TOL)

    # Verify-shaped follow-up on the reused slot, padded to T = 2 with a 1-token row beside it.
    a_next2 = tokens(1, 12)
    step = Step([(0, len(new), new_next), (2, len(a) + 1, a_next2)], seed=15)
    new_verify, a_verify = step.run(model, cache)
    torch.testing.assert_close(new_verify, one_by_one(model, new + new_next)[len(new) :], **TOL)
    torch.testing.assert_close(a_verify, one_by_one(model, a + a_next + a_next2)[-1:], **TOL)


def test_aux_hidden_taps_are_the_residual_stream(model):
    ids = tokens(4, 16)
    inputs = Step([(0, 0, ids)]).inputs(model.device)
    out = model(*inputs, new_cache(model), aux_layers=(1, 0))
    assert out.aux_hidden.shape == (1, 4, 2 * CONFIG.hidden_size)
    # aux_layers=(1, 0): the second tap, layer 0's input, is the embeddings.
    embeddings = model.embed_tokens.weight[inputs[0][0]]
    torch.testing.assert_close(out.aux_hidden[0, :, CONFIG.hidden_size :], embeddings)
    with pytest.raises(ValueError, match="aux layer 2"):
        model(*inputs, new_cache(model), aux_layers=(2,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay_matches_eager(dtype):
    """forward captures into one CUDA graph (no host syncs) and replays new verify batches like eager."""
    model = build_model("cuda", dtype)
    cache = new_cache(model)
    Step([(3, 0, tokens(5, 20)), (0, 0, tokens(9, 21))]).run(model, cache)

    def verify_step(seed: int) -> Step:  # fixed shape [3, 3]; the last row is a pad row on the trash slot
        return Step([(3, 5, tokens(3, seed)), (0, 9, tokens(2, seed + 1)), (NUM_SLOTS, 0, [])], seed)

    static = verify_step(30).inputs(model.device)
    index = torch.arange(9, device=model.device)
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside forward raises
    try:
        model(*static, cache, index, aux_layers=(0, 1))  # warm-up: compiles the Triton kernels
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(*static, cache, index, aux_layers=(0, 1))

    for seed in (40, 50):
        step = verify_step(seed)
        for buf, value in zip(static, step.inputs(model.device), strict=True):
            buf.copy_(value)
        eager_cache = KVCache(cache.k.clone(), cache.v.clone())
        eager = model(*static, eager_cache, index, aux_layers=(0, 1))
        before_k, before_v = cache.k.clone(), cache.v.clone()
        graph.replay()
        step.check_writes(cache, before_k, before_v)
        torch.testing.assert_close(captured.logits, eager.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured.aux_hidden, eager.aux_hidden)
        torch.testing.assert_close(cache.k[:, :NUM_SLOTS], eager_cache.k[:, :NUM_SLOTS])
        torch.testing.assert_close(cache.v[:, :NUM_SLOTS], eager_cache.v[:, :NUM_SLOTS])
