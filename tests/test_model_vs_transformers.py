"""specwire.model against transformers' own Llama / Qwen2 / Mistral on identical weights (fp32, CPU)."""

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specwire.config import ModelConfig, default_aux_layers
from specwire.default_model import default_model_path
from specwire.errors import ModelLoadError
from specwire.model import KVCache, LlamaModel
from specwire.weights import load_checkpoint

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=False)),
    "llama_tied": (LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=True)),
    "llama3_rope": (LlamaForCausalLM, LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE), rope_theta=5e5)),
    "qwen2_bias": (Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=False)),
    "qwen2_bias_tied": (Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**TINY, sliding_window=None, head_dim=16)),
}
REL_TOL = 1e-4
# T = 100 runs past original_max_position_embeddings = 64 of the llama3 case.
IDS = torch.randint(0, TINY["vocab_size"], (2, 100), generator=torch.Generator().manual_seed(2))
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_checkpoint(case: str, tmp_path) -> torch.nn.Module:
    """A transformers model with non-trivial random weights, saved (safetensors) to tmp_path."""
    cls, hf_config = CASES[case]
    torch.manual_seed(0)
    hf = cls(hf_config).eval()
    # HF initialises norms to 1 and biases to 0, which would hide bugs in either.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(tmp_path)
    return hf


def load_ours(path, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs) -> LlamaModel:
    config, state_dict = load_checkpoint(path)
    model = LlamaModel(config, dtype, device, **kwargs)
    model.load_weights(state_dict)
    return model


def diff(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs diff relative to the reference's largest magnitude)."""
    abs_diff = (ours - ref).abs().max().item()
    return abs_diff, abs_diff / ref.abs().max().item()


def run_chunks(model: LlamaModel, ids: torch.Tensor, bounds: list[int], aux: tuple[int, ...]):
    """Feed ids [B, T] in chunks [bounds[j], bounds[j+1]) through the cache; concatenate the outputs."""
    B, T = ids.shape
    cache = KVCache.allocate(model.config, num_slots=B, max_context=T, dtype=model.dtype, device="cpu")
    slots = torch.arange(B, dtype=torch.int32)
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        start = torch.full((B,), s, dtype=torch.int32)
        num = torch.full((B,), e - s, dtype=torch.int32)
        outs.append(model(ids[:, s:e], start, num, slots, cache, aux_layers=aux))
    logits = torch.cat([o.logits.view(B, -1, model.config.vocab_size) for o in outs], dim=1)
    hidden = torch.cat([o.hidden for o in outs], dim=1)
    aux_hidden = torch.cat([o.aux_hidden for o in outs], dim=1)
    return logits, hidden, aux_hidden


def check_against(hf: torch.nn.Module, model: LlamaModel, ids: torch.Tensor, bounds: list[int],
                  aux: tuple[int, ...], label: str) -> None:
    """Logits, final normed hidden state and the residual stream entering each aux layer."""
    logits, hidden, aux_hidden = run_chunks(model, ids, bounds, aux)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)  # hidden_states[i] enters layer i; [-1] is normed
    abs_l, rel_l = diff(logits, ref.logits)
    abs_h, rel_h = diff(hidden, ref.hidden_states[-1])
    abs_a, rel_a = diff(aux_hidden, torch.cat([ref.hidden_states[i] for i in aux], dim=-1))
    print(f"{label}: logits abs {abs_l:.2e} rel {rel_l:.2e}; hidden abs {abs_h:.2e} rel {rel_h:.2e}; "
          f"aux abs {abs_a:.2e} rel {rel_a:.2e}")
    assert rel_l <= REL_TOL
    assert rel_h <= REL_TOL
    assert rel_a <= REL_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_hidden_match_transformers(case, tmp_path):
    hf = tiny_checkpoint(case, tmp_path)
    model = load_ours(tmp_path)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    # Prefill 60, decode 1, then a 39-token chunk: every cache path against one full transformers pass.
    check_against(hf, model, IDS, [0, 60, 61, 100], (0, 1, model.config.num_layers - 1), case)


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        ("cpu", torch.bfloat16),
        ("cpu", torch.float16),
        pytest.param("cuda", torch.float32, marks=[pytest.mark.gpu, requires_cuda]),
        pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, requires_cuda]),
        pytest.param("cuda", torch.float16, marks=[pytest.mark.gpu, requires_cuda]),
    ],
)
@pytest.mark.parametrize("case", ["llama3_rope", "qwen2_bias"])
def test_other_dtypes_and_devices_close_to_transformers_fp32(case, device, dtype, tmp_path):
    """Our error against transformers fp32 is at most about transformers' own error in the same dtype."""
    hf = tiny_checkpoint(case, tmp_path)
    model = load_ours(tmp_path, dtype, device)
    B, T = IDS.shape
    cache = KVCache.allocate(model.config, B, T, dtype, device)
    full = torch.full((B,), T, dtype=torch.int32, device=device)
    out = model(IDS.to(device), 0 * full, full, torch.arange(B, dtype=torch.int32, device=device), cache)
    with torch.no_grad():
        ref = hf(IDS).logits.flatten(0, 1)
        hf_low = hf.to(dtype)(IDS).logits.flatten(0, 1).float()
    abs_l, rel_l = diff(out.logits.cpu(), ref)
    hf_rel = diff(hf_low, ref)[1]
    print(f"{case} {device} {dtype}: logits abs {abs_l:.2e} rel {rel_l:.2e}; transformers rel {hf_rel:.2e}")
    assert out.logits.dtype == torch.float32
    assert rel_l <= 2 * hf_rel + REL_TOL


@pytest.mark.slow  # transformers dequantizes the 135M GGUF in about 20 s on 2 busy cores
def test_default_gguf_matches_transformers(hf_model):
    model = load_ours(default_model_path(), max_positions=64)
    config = model.config
    assert config.tie_word_embeddings and config.num_layers == 30
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    check_against(hf_model, model, ids, [0, 20, 24], default_aux_layers(config.num_layers),
                  "smollm2_gguf")


def test_config_from_transformers_dicts():
    llama3 = ModelConfig.from_hf_dict(CASES["llama3_rope"][1].to_dict())
    assert llama3.rope_scaling == LLAMA3_ROPE and llama3.rope_theta == 5e5 and llama3.head_dim == 16
    qwen2 = ModelConfig.from_hf_dict(CASES["qwen2_bias_tied"][1].to_dict())
    assert qwen2.attention_bias and qwen2.tie_word_embeddings and qwen2.num_kv_heads == 2
    # transformers 4.x layout: rope_theta at top level, rope_scaling with the old "type" key, eos a list.
    old_scaling = {("type" if k == "rope_type" else k): v for k, v in LLAMA3_ROPE.items()}
    old = {**TINY, "model_type": "llama", "rope_theta": 1e4, "rope_scaling": old_scaling}
    old["eos_token_id"] = [5, 7]
    parsed = ModelConfig.from_hf_dict(old)
    assert parsed.rope_scaling == LLAMA3_ROPE and parsed.eos_token_ids == (5, 7) and not parsed.attention_bias


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        (MistralConfig(**TINY, sliding_window=64).to_dict(), "sliding_window=64"),
        ({**TINY, "model_type": "llama", "rope_scaling": {"rope_type": "yarn"}}, "rope_type 'yarn'"),
    ],
)
def test_config_rejects_unsupported(config, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(config)


def test_load_weights_names_the_bad_tensor(tmp_path):
    tiny_checkpoint("qwen2_bias", tmp_path)
    config, state_dict = load_checkpoint(tmp_path)
    model = LlamaModel(config)
    bad = "model.layers.1.self_attn.k_proj.bias"
    with pytest.raises(ModelLoadError, match=f"missing tensor '{bad}'"):
        model.load_weights({k: v for k, v in state_dict.items() if k != bad})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.9.mlp.up_proj.weight'"):
        model.load_weights({**state_dict, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=rf"'{bad}' has shape \(31,\), expected \(32,\)"):
        model.load_weights({**state_dict, bad: torch.zeros(31)})
