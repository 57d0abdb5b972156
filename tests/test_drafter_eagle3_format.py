"""A head written by specwire (save_eagle_head, as train-eagle and the shipped head use it) is in the EAGLE-3
format that vLLM and SGLang load.

The published names checked here were read from upstream (facts, not code):
- vLLM vllm/model_executor/models/llama_eagle3.py @ 00bd1493 and registry.py: architecture
  "LlamaForCausalLMEagle3" -> Eagle3LlamaForCausalLM; config keys draft_vocab_size, target_hidden_size (fc
  input = 3 x target_hidden_size), bias (fc and o_proj bias); load_weights skips "t2d", renames "d2t" to
  draft_id_to_target_id (int64 offsets: target = draft + d2t), prefixes "model." to every name but lm_head,
  maps "midlayer." to "layers.0." and stacks q/k/v into qkv_proj, gate/up into gate_up_proj.
- SGLang python/sglang/srt/models/llama_eagle3.py @ 03d5a777: EntryClass LlamaForCausalLMEagle3; fc bias from
  config "bias"; lm_head of draft_vocab_size rows unless tie_word_embeddings; "d2t" -> hot_token_id = d2t +
  arange, "t2d" skipped; other names are looked up as-is or under "model." (unknown names are silently
  dropped, which is why the exact names matter).
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from specwire.drafter.eagle_head import DEFAULT_HEAD, EagleHead, EagleHeadConfig, save_eagle_head
from test_drafter_head import DRAFT_VOCAB, HEADS, INTER, KV_HEADS, VOCAB, H, tiny_target

from specwire.config import default_aux_layers

LAYER = [
    "input_layernorm",
    "hidden_norm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
PUBLISHED = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in LAYER
}
STACKED = [
    (".q_proj", ".qkv_proj"),
    (".k_proj", ".qkv_proj"),
    (".v_proj", ".qkv_proj"),
    (".gate_proj", ".gate_up_proj"),
    (".up_proj", ".gate_up_proj"),
]
FUSED_LAYER = [
    "input_layernorm",
    "hidden_norm",
    "post_attention_layernorm",
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
]
VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"} | {
    f"model.layers.0.{n}.weight" for n in FUSED_LAYER
}
SGLANG_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {
    f"model.midlayer.{n}.weight" for n in FUSED_LAYER
}


def stack(name: str) -> str:
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def vllm_names(keys) -> set[str]:
    """Where vLLM's Eagle3LlamaForCausalLM.load_weights puts each checkpoint tensor."""
    out = set()
    for k in keys:
        if "t2d" in k:
            continue
        if "d2t" in k:
            out.add("draft_id_to_target_id")
            continue
        name = k if "lm_head" in k else "model." + k
        out.add(stack(name.replace("midlayer.", "layers.0.")))
    return out


def sglang_names(keys) -> set[str]:
    """Where SGLang's LlamaForCausalLMEagle3.load_weights puts each tensor (d2t -> hot_token_id)."""
    return {stack(k if k == "lm_head.weight" else "model." + k) for k in keys if k not in ("d2t", "t2d")}


def check_format(path, target_vocab: int, target_hidden: int, aux: tuple[int, ...]) -> None:
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == target_vocab and config["target_hidden_size"] == target_hidden
    assert config["bias"] is False  # vLLM reads it as the o_proj bias too
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(aux)
    N, Hd = config["draft_vocab_size"], config["hidden_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    assert set(tensors) == PUBLISHED
    assert vllm_names(tensors) == VLLM_PARAMS and sglang_names(tensors) == SGLANG_PARAMS
    shapes = {
        "fc.weight": (Hd, 3 * target_hidden),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * Hd),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * Hd),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * Hd),
        "midlayer.self_attn.o_proj.weight": (Hd, heads * hd),
        "midlayer.mlp.gate_proj.weight": (config["intermediate_size"], Hd),
        "midlayer.mlp.down_proj.weight": (Hd, config["intermediate_size"]),
        "midlayer.hidden_norm.weight": (Hd,),
        "norm.weight": (Hd,),
        "lm_head.weight": (N, Hd),
        "d2t": (N,),
        "t2d": (target_vocab,),
    }
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    target_ids = torch.arange(N) + tensors["d2t"]  # vLLM: base + draft_id_to_target_id; SGLang: hot_token_id
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < target_vocab
    assert target_ids.unique().numel() == N
    assert int(tensors["t2d"].sum()) == N and bool(tensors["t2d"][target_ids].all())


def test_saved_eagle3_head_has_the_published_names_shapes_and_config(tmp_path):
    config, sd = tiny_target()
    head_config = EagleHeadConfig.for_target(config, "eagle3", DRAFT_VOCAB)
    head = EagleHead(head_config, sd, torch.float32, "cpu", 64)
    head.init_weights(0)
    chosen = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB].sort().values
    head.draft_to_target.copy_(chosen)
    save_eagle_head(head, tmp_path)
    check_format(tmp_path, VOCAB, H, default_aux_layers(config.num_layers))
    assert (H, HEADS, KV_HEADS, INTER) == (64, 4, 2, 96)
    torch.testing.assert_close(
        load_file(tmp_path / "model.safetensors")["d2t"] + torch.arange(DRAFT_VOCAB), chosen
    )


def test_the_broken_format_is_caught():
    """The name check fails for a head saved under EAGLE-1 layer names (SGLang wants midlayer.*), without its
    lm_head or without its d2t."""
    eagle1 = {k.replace("midlayer.", "layers.0.") for k in PUBLISHED}
    assert vllm_names(eagle1) == VLLM_PARAMS and sglang_names(eagle1) != SGLANG_PARAMS
    assert sglang_names(PUBLISHED - {"lm_head.weight"}) != SGLANG_PARAMS
    assert vllm_names(PUBLISHED - {"d2t"}) != VLLM_PARAMS


def test_shipped_head_is_a_specwire_trained_eagle3_head_in_the_published_format():
    config = json.loads((DEFAULT_HEAD / "config.json").read_text())
    if config["architectures"] != ["LlamaForCausalLMEagle3"]:
        pytest.skip("the shipped head is not an EAGLE-3 head")
    log = json.loads((DEFAULT_HEAD / "train_log.json").read_text())
    assert log["arch"] == "eagle3" and log["hyperparameters"]["ttt_steps"] == 7
    check_format(DEFAULT_HEAD, 49152, 576, (2, 15, 27))
