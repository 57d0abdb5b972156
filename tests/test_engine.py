"""TargetEngine: the step API (prefill / decode / verify agree), slots, generate() with seeds, stop strings
and EOS, and (on CUDA) CUDA-graph decode against eager."""

import pytest
import torch

from specwire.config import ModelConfig
from specwire.default_model import default_model_path
from specwire.engine import TargetEngine, capture_sizes
from specwire.errors import ModelLoadError
from specwire.sampling_params import SamplingParams
from specwire.weights import checkpoint_shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def engine() -> TargetEngine:
    return TargetEngine(device="cpu", max_slots=2, max_context=128, cuda_graphs=False)


def chat(engine: TargetEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def tiny_checkpoint(seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random small Llama (GQA, untied head) for tests that need no tokenizer."""
    config = ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(),
    )
    gen = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    # Norm weights near 1, the rest near 0: non-trivial everywhere.
    state = {n: float(len(s) == 1) + 0.1 * torch.randn(s, generator=gen) for n, s in shapes.items()}
    return config, state


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4) -> bool:
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


# ----------------------------------------------------------------------------------------------- step API


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_slots_allocate_and_free(engine):
    slots = [engine.allocate_slot(), engine.allocate_slot()]
    assert sorted(slots) == [0, 1] and engine.num_free_slots == 0
    with pytest.raises(RuntimeError, match="slots are in use"):
        engine.allocate_slot()
    for slot in slots:
        engine.free_slot(slot)
    with pytest.raises(ValueError, match="not allocated"):
        engine.free_slot(slots[0])
    assert engine.num_free_slots == 2


def test_prefill_decode_verify_agree():
    """Feeding prompt + continuation in one prefill, in chunks, via verify, or token by token via decode
    gives the same logits and hidden states; batch neighbours of other lengths change nothing."""
    engine = TargetEngine(device="cpu", max_slots=3, max_context=64, cuda_graphs=False,
                          aux_layers=(0, 2), checkpoint=tiny_checkpoint())
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(512, (20,), generator=gen).tolist()
    cont = torch.randint(512, (4,), generator=gen).tolist()
    other = torch.randint(512, (7,), generator=gen).tolist()
    full = prompt + cont

    ref = engine.prefill([(0, full)])
    assert ref.logits.shape == (1, 512) and ref.hidden.shape == (24, 128)
    assert ref.aux_hidden.shape == (24, 256)

    # A batch of two prompts of different lengths, chunked into 5-token pieces.
    engine.max_prefill_tokens = 10
    both = engine.prefill([(1, other), (0, full)])
    engine.max_prefill_tokens = 8192
    assert close(both.logits[1], ref.logits[0]) and close(both.hidden[7:], ref.hidden)
    assert close(both.aux_hidden[7:], ref.aux_hidden)
    alone = engine.prefill([(2, other)])
    assert close(both.logits[0], alone.logits[0]) and close(both.hidden[:7], alone.hidden)

    # Prompt, then the continuation in one verify step (slot 1, next to a shorter row in slot 2).
    engine.prefill([(1, prompt)])
    out = engine.verify([2, 1], [other[-1:], cont], [6, 20])
    assert out.logits.shape == (5, 512)
    assert close(out.logits[-1], ref.logits[0]) and close(out.hidden[1:], ref.hidden[20:])
    assert close(out.aux_hidden[1:], ref.aux_hidden[20:])

    # Prompt, then the continuation one decode step at a time.
    engine.prefill([(1, prompt)])
    for i, token in enumerate(cont):
        step = engine.decode([1], [token], [20 + i])
        assert close(step.hidden[0], ref.hidden[20 + i])
    assert close(step.logits[0], ref.logits[0])


def test_engine_rejects_bad_requests(engine):
    prompt = chat(engine, "Hi")
    with pytest.raises(ValueError, match="exceeds the context length 128"):
        engine.generate([prompt], [SamplingParams(max_tokens=128 - len(prompt) + 1)])
    with pytest.raises(ValueError, match="token id -1 out of range"):
        engine.generate([[1, -1]], [SamplingParams(max_tokens=4)])
    with pytest.raises(ValueError, match="top_k=50000 exceeds the vocabulary size 49152"):
        engine.generate([prompt], [SamplingParams(top_k=50000)])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[]], [SamplingParams()])
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=8192"):
        TargetEngine(device="cpu", max_slots=1, max_context=10000)
    with pytest.raises(ModelLoadError, match="does not exist"):
        TargetEngine("/nonexistent/model.gguf", device="cpu")
    assert engine.num_free_slots == 2


# ----------------------------------------------------------------------------------------------- generate


def test_seeded_sampling_repeats_whatever_the_batch(engine):
    """Request a's tokens depend on its seed only: alone, in a batch, or joining once a slot frees up
    (max_slots is 2, so the third request waits while the others decode)."""
    a = (chat(engine, "Tell me a story."), SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=10,
                                                          ignore_eos=True))
    b = (chat(engine, "Name a fruit."), SamplingParams(temperature=1.0, top_k=40, seed=3, max_tokens=3,
                                                       ignore_eos=True))
    c = (chat(engine, "Count to five."), SamplingParams(temperature=0.7, seed=11, max_tokens=10,
                                                        ignore_eos=True))

    def run(*requests):
        return engine.generate([r[0] for r in requests], [r[1] for r in requests])

    alone = run(a)[0].token_ids
    assert len(alone) == 10
    assert run(b, a, c)[1].token_ids == alone  # a decodes next to b, then next to c
    assert run(c, b, a)[2].token_ids == alone  # a joins when b leaves, mid-way through c
    other_seed = (a[0], SamplingParams(temperature=0.9, top_p=0.95, seed=8, max_tokens=10, ignore_eos=True))
    assert run(other_seed)[0].token_ids != alone  # the seed matters: sampling is really random
    assert engine.num_free_slots == 2


def test_stop_strings(engine):
    prompt = chat(engine, "Say hi.")
    full = engine.generate([prompt], [SamplingParams(max_tokens=24, ignore_eos=True)])[0]
    later, earlier = full.text[14:18], full.text[6:10]
    assert later and earlier and later not in full.text[:14]
    cut = full.text.index(earlier)
    result = engine.generate([prompt], [SamplingParams(max_tokens=24, stop=(later, earlier))])[0]
    assert result.finish_reason == "stop"
    assert result.text == full.text[:cut]
    n = len(result.token_ids)
    assert result.token_ids == full.token_ids[:n]
    # It stopped at the first token whose text completes the stop string.
    assert earlier in engine.tokenizer.decode(result.token_ids)
    assert earlier not in engine.tokenizer.decode(result.token_ids[:-1])


def test_eos_stops_unless_ignored(engine):
    prompt = chat(engine, "What is 2+2? Answer with one number.")
    result = engine.generate([prompt], [SamplingParams(max_tokens=32)])[0]
    eos = set(engine.tokenizer.eos_token_ids)
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in eos and not eos & set(result.token_ids[:-1])
    assert result.text == engine.tokenizer.decode(result.token_ids)  # EOS itself is not in the text
    n = len(result.token_ids)
    longer = engine.generate([prompt], [SamplingParams(max_tokens=n + 3, ignore_eos=True)])[0]
    assert longer.finish_reason == "length"
    assert len(longer.token_ids) == n + 3 and longer.token_ids[:n] == result.token_ids
    assert result.stats["tokens"] == n and result.stats["tokens_per_s"] > 0


# ----------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("step", ["decode", "verify"])
def test_cuda_graph_step_matches_eager(step):
    """Graph replay (3 rows padded to 4; verify rows of 5, 2 and 3 tokens padded to width 5) equals the
    eager step, and pad rows and pad tokens touch only the trash slot."""
    engine = TargetEngine(device="cuda", dtype=torch.float32, max_slots=8, max_context=64,
                          aux_layers=(1,), max_verify_tokens=5, checkpoint=tiny_checkpoint())
    assert [(g.width, g.sizes) for g in engine.graphs] == [(1, [1, 2, 4, 8]), (5, [1, 2, 4, 8])]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(512, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    slots = [3, 0, 6]
    engine.prefill(list(zip(slots, prompts, strict=True)))
    positions = [len(p) for p in prompts]
    if step == "decode":
        fed = [[11], [22], [33]]
        run = lambda: engine.decode(slots, [t[0] for t in fed], positions)  # noqa: E731
    else:
        fed = [[11, 12, 13, 14, 15], [22, 23], [33, 34, 35]]
        run = lambda: engine.verify(slots, fed, positions)  # noqa: E731
    before = (engine.cache.k.clone(), engine.cache.v.clone())

    graph = run()
    after_graph = (engine.cache.k.clone(), engine.cache.v.clone())
    engine.cache.k.copy_(before[0])
    engine.cache.v.copy_(before[1])
    graphs, engine.graphs = engine.graphs, []
    eager = run()
    engine.graphs = graphs

    assert graph.logits.shape[0] == sum(len(t) for t in fed)
    assert close(graph.logits, eager.logits, 1e-5) and close(graph.hidden, eager.hidden, 1e-5)
    assert close(graph.aux_hidden, eager.aux_hidden, 1e-5)
    live = slice(0, engine.max_slots)  # everything but the trash slot
    assert close(after_graph[0][:, live], engine.cache.k[:, live], 1e-5)
    untouched = [s for s in range(engine.max_slots) if s not in slots]
    assert torch.equal(after_graph[0][:, untouched], before[0][:, untouched])
    assert torch.equal(after_graph[1][:, untouched], before[1][:, untouched])

    # The static graph outputs are overwritten by the next replay; what the step returned is not.
    kept = graph.logits.clone()
    engine.decode([5], [7], [0])
    engine.verify([5], [[7, 8, 9]], [1])
    assert torch.equal(graph.logits, kept)


@pytest.mark.gpu
@gpu
def test_cuda_generate_with_graphs_matches_eager():
    try:
        default_model_path()
    except ModelLoadError:
        pytest.skip("default model not installed")
    params = [SamplingParams(max_tokens=24),
              SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]
    results = []
    for cuda_graphs in (True, False):
        engine = TargetEngine(device="cuda", dtype=torch.float32, max_slots=4, max_context=256,
                              cuda_graphs=cuda_graphs)
        prompts = [chat(engine, "Write a haiku about rain."), chat(engine, "Why is the sky blue?")] * 3
        results.append([r.token_ids for r in engine.generate(prompts, params * 3)])
    assert results[0] == results[1]
