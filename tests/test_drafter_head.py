"""EAGLE heads: published checkpoint formats load, and the head matches a transformers-built reference."""

import json

import pytest
import torch
from safetensors.torch import save_file
from specwire.drafter.eagle_head import (
    grow_draft_vocab,
    load_eagle_head,
    save_eagle_head,
    widen_attention,
    widen_mlp,
)
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specwire.config import ModelConfig, default_aux_layers
from specwire.errors import ModelLoadError
from specwire.model import KVCache
from specwire.weights import checkpoint_shapes

# head_dim 16: the smallest the Triton attention kernel takes (the GPU test shares these shapes).
H, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 64, 4, 2, 96, 96, 40, 8


def tiny_target(seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=H // HEADS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(),
    )
    g = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config)
    return config, {n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()}


def head_hf_config() -> dict:
    return {
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "hidden_act": "silu",
    }


def published_tensors(arch: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random tensors under the key names of SafeAILab's released heads (plus keys they carry but we skip)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    q, kv = H, KV_HEADS * (H // HEADS)
    attn_in = H if arch == "eagle1" else 2 * H
    prefix = "layers.0." if arch == "eagle1" else "midlayer."
    sd = {
        prefix + "self_attn.q_proj.weight": rand(q, attn_in),
        prefix + "self_attn.k_proj.weight": rand(kv, attn_in),
        prefix + "self_attn.v_proj.weight": rand(kv, attn_in),
        prefix + "self_attn.o_proj.weight": rand(H, q),
        prefix + "post_attention_layernorm.weight": 1 + rand(H),
        prefix + "mlp.gate_proj.weight": rand(INTER, H),
        prefix + "mlp.up_proj.weight": rand(INTER, H),
        prefix + "mlp.down_proj.weight": rand(H, INTER),
        "embed_tokens.weight": rand(VOCAB, H),  # some releases ship a copy; the target's is used
    }
    if arch == "eagle1":
        sd |= {"fc.weight": rand(H, 2 * H), "fc.bias": rand(H)}
    else:
        d2t = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values - torch.arange(DRAFT_VOCAB)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[torch.arange(DRAFT_VOCAB) + d2t] = True
        sd |= {
            "fc.weight": rand(H, 3 * H),
            prefix + "input_layernorm.weight": 1 + rand(H),
            prefix + "hidden_norm.weight": 1 + rand(H),
            "norm.weight": 1 + rand(H),
            "lm_head.weight": rand(DRAFT_VOCAB, H),
            "d2t": d2t,
            "t2d": t2d,
        }
    return sd


def write_head(tmp_path, arch: str, fmt: str) -> tuple:
    sd = published_tensors(arch)
    (tmp_path / "config.json").write_text(
        json.dumps(
            head_hf_config() | ({"draft_vocab_size": DRAFT_VOCAB} if arch == "eagle3" else {"bias": True})
        )
    )
    if fmt == "bin":
        torch.save(sd, tmp_path / "pytorch_model.bin")
    else:
        save_file(sd, tmp_path / "model.safetensors")
    return sd


def reference_head(arch: str, sd: dict, target_sd: dict, ids: torch.Tensor, feats: torch.Tensor):
    """The head over a whole sequence, built from transformers' LlamaDecoderLayer the way SafeAILab's
    cnets1.py (EAGLE-1: no input norm in layer 0) and cnets.py (EAGLE-3 midlayer) wire it."""
    cfg = LlamaConfig(**head_hf_config())
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0)
    prefix = "layers.0." if arch == "eagle1" else "midlayer."
    if arch == "eagle3":  # q/k/v read cat[embed, hidden]: 2H wide
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, nn.Linear(2 * H, old.out_features, bias=False))
    layer.load_state_dict(
        {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix) and "hidden_norm" not in k},
        strict=False,
    )
    T = ids.shape[1]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    pos = torch.arange(T)[None]
    rope = LlamaRotaryEmbedding(cfg)(feats, pos)
    embeds = target_sd["model.embed_tokens.weight"][ids]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    if arch == "eagle1":
        x = torch.cat([embeds, feats], -1) @ sd["fc.weight"].T + sd["fc.bias"]
        attn_in, residual = x, x
    else:
        residual = feats @ sd["fc.weight"].T
        attn_in = torch.cat(
            [
                rms(embeds, sd[prefix + "input_layernorm.weight"]),
                rms(residual, sd[prefix + "hidden_norm.weight"]),
            ],
            -1,
        )
    h = residual + layer.self_attn(attn_in, rope, mask)[0]
    out = h + layer.mlp(layer.post_attention_layernorm(h))
    if arch == "eagle1":
        return out, out @ target_sd["lm_head.weight"].T
    return out, rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T


def run_head(head, ids: torch.Tensor, feats: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed the sequence in chunks through the head's KV cache (slot 1 of 2)."""
    cache = KVCache.allocate(head.config.layer, 2, 64, torch.float32, "cpu")
    outs, start = [], 0
    for n in chunks:
        out = head(
            ids[:, start : start + n],
            feats[:, start : start + n],
            torch.tensor([start], dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            cache.k[0],
            cache.v[0],
        )
        outs.append(out)
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    "arch,fmt", [("eagle1", "bin"), ("eagle1", "safetensors"), ("eagle3", "bin"), ("eagle3", "safetensors")]
)
def test_published_head_matches_reference(tmp_path, arch, fmt):
    target_config, target_sd = tiny_target()
    sd = write_head(tmp_path, arch, fmt)
    head = load_eagle_head(tmp_path, target_config, target_sd)
    assert head.config.arch == arch
    g = torch.Generator().manual_seed(2)
    T = 7
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    feats = torch.randn(1, T, head.config.feature_dim, generator=g)
    want_out, want_logits = reference_head(arch, sd, target_sd, ids, feats)
    got = run_head(head, ids, feats, [4, 1, 2])  # prefill, then cached steps
    torch.testing.assert_close(got, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(head.logits(got), want_logits, atol=1e-4, rtol=1e-4)


def test_eagle3_d2t_maps_draft_ids_to_target_ids(tmp_path):
    target_config, target_sd = tiny_target()
    sd = write_head(tmp_path, "eagle3", "safetensors")
    head = load_eagle_head(tmp_path, target_config, target_sd)
    want = torch.arange(DRAFT_VOCAB) + sd["d2t"]
    assert torch.equal(head.draft_to_target, want)
    assert bool(sd["t2d"][head.draft_to_target].all())  # the released t2d marks exactly these ids
    assert head.config.aux_layers == default_aux_layers(LAYERS) == (2, 4, 5)
    assert head.vocab_size == DRAFT_VOCAB and head.config.feature_dim == 3 * H


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_save_then_load_round_trips(tmp_path, arch):
    target_config, target_sd = tiny_target()
    (tmp_path / "src").mkdir()
    write_head(tmp_path / "src", arch, "safetensors")
    head = load_eagle_head(tmp_path / "src", target_config, target_sd)
    save_eagle_head(head, tmp_path / "dst", dtype=torch.float32)
    again = load_eagle_head(tmp_path / "dst", target_config, target_sd)
    for k, v in head.published_state_dict().items():
        assert torch.equal(again.published_state_dict()[k], v), k


def test_bad_checkpoints_raise_one_line_errors(tmp_path):
    target_config, target_sd = tiny_target()
    sd = write_head(tmp_path, "eagle1", "safetensors")
    del sd["layers.0.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensor 'layers.0.mlp.up_proj.weight'"):
        load_eagle_head(tmp_path, target_config, target_sd)
    sd = write_head(tmp_path, "eagle3", "safetensors")
    sd["d2t"][-1] = VOCAB
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="d2t maps outside"):
        load_eagle_head(tmp_path, target_config, target_sd)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_eagle_head(tmp_path / "nowhere", target_config, target_sd)


def grown_head_check(tmp_path, arch: str, grow) -> tuple:
    """A trained head of `arch` and `grow(head, target weights)` of it, checked to compute what the head did,
    also once saved and loaded again; returns (head, grown head, its published weights, target weights)."""
    target_config, target_sd = tiny_target()
    (tmp_path / "src").mkdir()
    write_head(tmp_path / "src", arch, "safetensors")
    head = load_eagle_head(tmp_path / "src", target_config, target_sd)
    wide = grow(head, target_sd)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 6), generator=g)
    feats = torch.randn(1, 6, head.config.feature_dim, generator=g)
    want = run_head(head, ids, feats, [4, 2])
    torch.testing.assert_close(run_head(wide, ids, feats, [4, 2]), want, atol=1e-5, rtol=1e-5)
    save_eagle_head(wide, tmp_path / "dst", dtype=torch.float32)
    again = load_eagle_head(tmp_path / "dst", target_config, target_sd)
    assert again.config.layer == wide.config.layer
    torch.testing.assert_close(run_head(again, ids, feats, [4, 2]), want, atol=1e-5, rtol=1e-5)
    return head, wide, wide.published_state_dict(), target_sd


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_widened_mlp_computes_what_the_head_did(tmp_path, arch):
    """widen_mlp grows a trained head's MLP for more training: the same outputs at first (the new units'
    down_proj columns are zero), the new width in what it saves, and it never narrows."""
    head, wide, grown, target_sd = grown_head_check(tmp_path, arch, lambda h, sd: widen_mlp(h, 3 * INTER, sd))
    assert wide.config.layer.intermediate_size == 3 * INTER
    prefix = "layers.0." if arch == "eagle1" else "midlayer."
    assert grown[prefix + "mlp.down_proj.weight"].shape == (H, 3 * INTER)
    assert not grown[prefix + "mlp.down_proj.weight"][:, INTER:].any()
    assert grown[prefix + "mlp.gate_proj.weight"][INTER:].abs().sum() > 0  # random, so they can learn
    with pytest.raises(ValueError, match="cannot widen"):
        widen_mlp(head, INTER // 2, target_sd)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_widened_attention_computes_what_the_head_did(tmp_path, arch):
    """widen_attention adds query heads (and key/value heads, keeping the grouping) for more training: the
    same outputs at first (the new heads' o_proj columns are zero), the new head counts in the published
    config it saves; it never narrows, and heads come in whole groups."""
    def double(head, sd):
        return widen_attention(head, 2 * head.config.layer.num_heads, sd)

    head, wide, grown, target_sd = grown_head_check(tmp_path, arch, double)
    layer = head.config.layer
    group = layer.num_heads // layer.num_kv_heads
    assert (wide.config.layer.num_heads, wide.config.layer.num_kv_heads) == (2 * layer.num_heads,
                                                                             2 * layer.num_kv_heads)
    prefix = "layers.0." if arch == "eagle1" else "midlayer."
    q_cols = layer.num_heads * layer.head_dim
    assert grown[prefix + "self_attn.o_proj.weight"].shape == (H, 2 * q_cols)
    assert not grown[prefix + "self_attn.o_proj.weight"][:, q_cols:].any()
    assert grown[prefix + "self_attn.k_proj.weight"][layer.num_kv_heads * layer.head_dim:].abs().sum() > 0
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2 * layer.num_heads,
                                                                              2 * layer.num_kv_heads)
    same = widen_attention(head, layer.num_heads, target_sd)  # a warm start given the width it has
    assert same.config.layer == layer
    with pytest.raises(ValueError, match="cannot widen"):
        widen_attention(head, layer.num_heads - group, target_sd)
    with pytest.raises(ValueError, match=f"groups of {group}"):
        widen_attention(head, layer.num_heads + group + 1, target_sd)


def test_a_grown_draft_vocabulary_keeps_the_trained_logits_and_maps_the_targets_rows_in(tmp_path):
    """grow_draft_vocab widens an EAGLE-3 head's draft vocabulary for more training: old tokens keep their
    logits exactly; a new token's output row is the target's row for it carried through the linear map
    taking the target's rows of the old tokens onto their trained rows; it saves, loads, never shrinks."""
    target_config, target_sd = tiny_target()
    (tmp_path / "src").mkdir()
    write_head(tmp_path / "src", "eagle3", "safetensors")
    head = load_eagle_head(tmp_path / "src", target_config, target_sd)
    old = head.draft_to_target.tolist()
    unseen = [t for t in range(VOCAB) if t not in old]
    a, b, t = old[0], old[5], unseen[0]
    target_rows = target_sd["lm_head.weight"]
    target_rows[t] = 0.25 * target_rows[a] + 0.75 * target_rows[b]  # a token the map must place exactly
    new = torch.tensor(sorted(old + unseen[:20]))
    grown = grow_draft_vocab(head, new, target_sd)
    assert grown.config.draft_vocab_size == len(old) + 20 and grown.draft_to_target.tolist() == new.tolist()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 6), generator=g)
    feats = torch.randn(1, 6, head.config.feature_dim, generator=g)
    out = run_head(head, ids, feats, [6])
    torch.testing.assert_close(run_head(grown, ids, feats, [6]), out)  # the same layer: the same outputs
    position = {tok: i for i, tok in enumerate(new.tolist())}
    kept = torch.tensor([position[tok] for tok in old])
    torch.testing.assert_close(grown.logits(out)[..., kept], head.logits(out))
    rows = grown.lm_head.weight
    torch.testing.assert_close(rows[position[t]], 0.25 * rows[position[a]] + 0.75 * rows[position[b]],
                               atol=1e-4, rtol=1e-4)
    assert all(rows[position[tok]].abs().sum() > 0 for tok in unseen[:20])
    save_eagle_head(grown, tmp_path / "dst", dtype=torch.float32)
    again = load_eagle_head(tmp_path / "dst", target_config, target_sd)
    assert again.draft_to_target.tolist() == new.tolist()
    torch.testing.assert_close(again.logits(out), grown.logits(out))
    with pytest.raises(ValueError, match="grows only"):
        grow_draft_vocab(head, new[:10], target_sd)
    with pytest.raises(ValueError, match="grows only"):
        grow_draft_vocab(head, new.flip(0), target_sd)
    (tmp_path / "e1").mkdir()
    write_head(tmp_path / "e1", "eagle1", "safetensors")
    with pytest.raises(ValueError, match="only EAGLE-3"):
        grow_draft_vocab(load_eagle_head(tmp_path / "e1", target_config, target_sd), new, target_sd)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_heads_device_is_its_tensors_device(tmp_path, device):
    """"cuda" spelled as its tensors' "cuda:0": the proposer compares a handed table's device with the head's
    to gather on-device features in one launch. A mismatch takes the path for a table on another GPU, whose
    per-request copies assume consecutive rows; tests/test_queued_drafts.py, with scattered rows, failed its
    four CUDA cases in session 36 (the likely cause: not yet re-run on a GPU)."""
    target_config, target_sd = tiny_target()
    write_head(tmp_path, "eagle1", "safetensors")
    head = load_eagle_head(tmp_path, target_config, target_sd, device=device)
    assert head.device == head.embed_tokens.weight.device == torch.zeros(1, device=device).device
