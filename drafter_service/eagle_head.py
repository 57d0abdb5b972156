"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) in the published checkpoint formats.

Conventions, as in SafeAILab/EAGLE (eagle/model/cnets1.py, cnets.py) and vLLM (llama_eagle*.py):

EAGLE-1/2 (keys fc.weight, fc.bias?, layers.0.*): x = fc(cat[embed(t+1), f_t]) feeds one Llama decoder layer
whose layer 0 has no input norm; the layer's output (the residual stream, no final norm) is the predicted
next feature and goes straight into the target's lm_head. f_t is the target's final *normed* hidden state.

EAGLE-3 (keys fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t): h = fc(cat[aux taps of layers
2, L//2, L-3]) (skipped when the input is already the head's own H-wide output); the attention input is
cat[input_layernorm(embed), hidden_norm(h)], so q/k/v take 2H; the residual is h; logits =
lm_head(norm(out)) over a draft vocabulary, and draft id d is target id d + d2t[d] (d2t holds offsets).

The embedding (and for EAGLE-1 the lm_head) are the target's; checkpoints may carry a copy of the embedding,
which is ignored. The attention, MLP and norms are the target model's own modules and ops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from specwire.drafter.draft_vocab import d2t_offsets, t2d_mask
from specwire.kernels import ops
from torch import nn

from specwire.config import ModelConfig, default_aux_layers
from specwire.errors import ModelLoadError
from specwire.model import DecoderLayer, Linear, LlamaModel, rope_cos_sin
from specwire.weights import check_tensors

Arch = Literal["eagle1", "eagle3"]
# The head shipped for the default model (trained by `specwire train-eagle`).
DEFAULT_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-eagle"
# Present in some published heads and not loaded: our embedding is the target's; t2d (implied by d2t) is
# only checked against d2t.
_IGNORED_KEYS = ("embed_tokens.weight", "t2d")


@dataclass(frozen=True)
class EagleHeadConfig:
    arch: Arch
    layer: ModelConfig  # the head's own decoder-layer shapes (num_layers is 1)
    target_hidden_size: int
    target_vocab_size: int
    fc_bias: bool = False
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input residual stream is tapped
    draft_vocab_size: int = 0  # EAGLE-3 only

    @classmethod
    def for_target(cls, target: ModelConfig, arch: Arch, draft_vocab_size: int) -> EagleHeadConfig:
        """A new head for `target`: its layer shapes, EAGLE-1's fc bias, EAGLE-3's default taps (and at
        most `draft_vocab_size` draft tokens)."""
        eagle3 = arch == "eagle3"
        return cls(
            arch=arch,
            layer=replace(target, num_layers=1),
            target_hidden_size=target.hidden_size,
            target_vocab_size=target.vocab_size,
            fc_bias=arch == "eagle1",
            aux_layers=default_aux_layers(target.num_layers) if eagle3 else (),
            draft_vocab_size=min(draft_vocab_size, target.vocab_size) if eagle3 else 0,
        )

    @property
    def feature_dim(self) -> int:
        """Width of one target feature: the normed final hidden (EAGLE-1) or the aux taps (EAGLE-3)."""
        return self.target_hidden_size * (len(self.aux_layers) if self.arch == "eagle3" else 1)


def shared_target_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The target tensors a head shares: the embedding and the lm_head (the same tensor when tied)."""
    return {"model.embed_tokens.weight": model.embed_tokens.weight, "lm_head.weight": model.lm_head.weight}


class EagleHead(nn.Module):
    """One EAGLE head over a 1-layer slot-indexed KV cache (specwire.model.KVCache with its trash slot)."""

    def __init__(
        self,
        config: EagleHeadConfig,
        target_weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int,
    ):
        super().__init__()
        self.config, self.dtype = config, dtype
        c, H = config.layer, config.layer.hidden_size
        self.embed_tokens = nn.Embedding.from_pretrained(
            target_weights["model.embed_tokens.weight"].to(device=device, dtype=dtype), freeze=True
        )
        # Its index spelled out ("cuda" -> "cuda:0"): a torch.device("cuda") compares unequal to its own
        # tensors' devices, which sent the proposer's on-device feature gather down the path for another GPU.
        self.device = self.embed_tokens.weight.device
        self.layer = DecoderLayer(c, dtype, device)
        if config.arch == "eagle1":
            self.fc = Linear(2 * H, H, bias=config.fc_bias, dtype=dtype, device=device)
            self.layer.input_layernorm = None  # layer 0 of an EAGLE-1 head has no input norm
            lm_head = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
            self.lm_head = Linear(H, config.target_vocab_size, bias=False, dtype=dtype, device="meta")
            self.lm_head.weight = nn.Parameter(lm_head.to(device=device, dtype=dtype), requires_grad=False)
            self.register_buffer("draft_to_target", None)
        else:
            self.fc = Linear(config.feature_dim, H, bias=config.fc_bias, dtype=dtype, device=device)
            # q/k/v read cat[embed, hidden]: 2H wide. Same Attention module, wider input projection.
            attn = self.layer.self_attn
            self.layer.self_attn.qkv_proj = Linear(
                2 * H, attn.qkv_proj.out_features, bias=c.attention_bias, dtype=dtype, device=device
            )
            self.hidden_norm = nn.Parameter(torch.ones(H, dtype=dtype, device=device))
            self.norm = nn.Parameter(torch.ones(H, dtype=dtype, device=device))
            self.lm_head = Linear(H, config.draft_vocab_size, bias=False, dtype=dtype, device=device)
            self.register_buffer(
                "draft_to_target", torch.arange(config.draft_vocab_size, device=device), persistent=False
            )
        self.register_buffer("cos_sin", rope_cos_sin(c, max_positions).to(device), persistent=False)

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary the head's logits range over (the draft vocabulary for EAGLE-3)."""
        return self.lm_head.out_features

    def init_weights(self, seed: int = 0) -> None:
        """Fresh weights for training: default nn.Linear init, unit norms (as EAGLE's nn.Modules start)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.trainable_parameters().items():
                if p.dim() == 1 and "bias" not in name:
                    p.fill_(1.0)
                elif p.dim() == 1:
                    p.zero_()
                else:
                    bound = p.shape[1] ** -0.5
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if self.config.arch == "eagle1" else set())
        return {n: p for n, p in self.named_parameters() if n not in shared}

    # ------------------------------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        start_pos: torch.Tensor,
        num_tokens: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        own_features: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] (token t+1), features [B, T, F] (feature of t) -> the head's output [B, T, H].

        features are target features (F = feature_dim) or, with own_features, the head's own outputs
        (F = H), which EAGLE-3 does not project through fc. Same slot/position semantics as
        LlamaModel.forward.
        """
        positions = start_pos[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
        attn_in, residual = self.attention_input(input_ids, features, own_features)
        hidden = self.layer.self_attn(
            attn_in, positions, self.cos_sin, k_cache, v_cache, slots, start_pos, num_tokens
        )
        return self.finish(hidden, residual)

    def attention_input(
        self, input_ids: torch.Tensor, features: torch.Tensor, own_features: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual stream) for tokens [B, T] and features [B, T, F]."""
        eps, layer = self.config.layer.rms_norm_eps, self.layer
        embeds = self.embed_tokens(input_ids)
        features = features.to(self.dtype)
        if self.config.arch == "eagle1":
            residual = self.fc(torch.cat([embeds, features], dim=-1))
            return residual, residual
        residual = features if own_features else self.fc(features)
        attn_in = torch.cat(
            [
                ops.rms_norm(embeds, layer.input_layernorm, eps),
                ops.rms_norm(residual, self.hidden_norm, eps),
            ],
            dim=-1,
        )
        return attn_in, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The head's output [.., H] from the attention's output and the residual stream."""
        layer = self.layer
        hidden, residual = ops.add_rms_norm(
            attn_out, residual, layer.post_attention_layernorm, self.config.layer.rms_norm_eps
        )
        return layer.mlp(hidden) + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over vocab_size for head outputs [..., H] (EAGLE-3: after the head's norm)."""
        if self.config.arch == "eagle3":
            hidden = ops.rms_norm(hidden, self.norm, self.config.layer.rms_norm_eps)
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------------------------ weights

    def published_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own tensors under the published key names (q/k/v and gate/up split again)."""
        layer, c = self.layer, self.config
        q, kv = c.layer.num_heads * c.layer.head_dim, c.layer.num_kv_heads * c.layer.head_dim
        prefix = "layers.0." if c.arch == "eagle1" else "midlayer."
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        sd = {
            "fc.weight": self.fc.weight,
            prefix + "self_attn.q_proj.weight": wq,
            prefix + "self_attn.k_proj.weight": wk,
            prefix + "self_attn.v_proj.weight": wv,
            prefix + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
        }
        if self.fc.bias is not None:
            sd["fc.bias"] = self.fc.bias
        if c.layer.attention_bias:
            bq, bk, bv = layer.self_attn.qkv_proj.bias.split([q, kv, kv])
            sd |= {
                prefix + "self_attn.q_proj.bias": bq,
                prefix + "self_attn.k_proj.bias": bk,
                prefix + "self_attn.v_proj.bias": bv,
            }
        if c.arch == "eagle3":
            sd |= {
                prefix + "input_layernorm.weight": layer.input_layernorm,
                prefix + "hidden_norm.weight": self.hidden_norm,
                "norm.weight": self.norm,
                "lm_head.weight": self.lm_head.weight,
                "d2t": d2t_offsets(self.draft_to_target),
            }
        return {k: v.detach() for k, v in sd.items()}

    @torch.no_grad()
    def load_published(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy in tensors named as published_state_dict names them; checks names and shapes."""
        expected = {k: tuple(v.shape) for k, v in self.published_state_dict().items()}
        kept = {k: v for k, v in sd.items() if not k.endswith((*_IGNORED_KEYS, "rotary_emb.inv_freq"))}
        check_tensors(kept, expected, f"{self.config.arch} EAGLE head")
        layer, c = self.layer, self.config
        prefix = "layers.0." if c.arch == "eagle1" else "midlayer."
        attn = prefix + "self_attn."
        self.fc.weight.copy_(sd["fc.weight"])
        if self.fc.bias is not None:
            self.fc.bias.copy_(sd["fc.bias"])
        layer.self_attn.qkv_proj.weight.copy_(torch.cat([sd[attn + f"{x}_proj.weight"] for x in "qkv"]))
        if c.layer.attention_bias:
            layer.self_attn.qkv_proj.bias.copy_(torch.cat([sd[attn + f"{x}_proj.bias"] for x in "qkv"]))
        layer.self_attn.o_proj.weight.copy_(sd[attn + "o_proj.weight"])
        layer.post_attention_layernorm.copy_(sd[prefix + "post_attention_layernorm.weight"])
        layer.mlp.gate_up_proj.weight.copy_(
            torch.cat([sd[prefix + "mlp.gate_proj.weight"], sd[prefix + "mlp.up_proj.weight"]])
        )
        layer.mlp.down_proj.weight.copy_(sd[prefix + "mlp.down_proj.weight"])
        if c.arch == "eagle3":
            layer.input_layernorm.copy_(sd[prefix + "input_layernorm.weight"])
            self.hidden_norm.copy_(sd[prefix + "hidden_norm.weight"])
            self.norm.copy_(sd["norm.weight"])
            self.lm_head.weight.copy_(sd["lm_head.weight"])
            d2t = torch.arange(c.draft_vocab_size) + sd["d2t"].long().cpu()
            if int(d2t.min()) < 0 or int(d2t.max()) >= c.target_vocab_size:
                raise ModelLoadError(
                    f"EAGLE-3 d2t maps outside the target vocabulary of {c.target_vocab_size}"
                )
            if "t2d" in sd and not torch.equal(sd["t2d"].bool().cpu(), t2d_mask(d2t, c.target_vocab_size)):
                raise ModelLoadError("EAGLE-3 t2d does not mark exactly the target ids that d2t maps to")
            self.draft_to_target.copy_(d2t)


# ---------------------------------------------------------------------------------------------- files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        return load_file(path / "model.safetensors")
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return {k: v for shard in shards for k, v in load_file(shard).items()}
    if (path / "pytorch_model.bin").exists():
        try:  # never unpickle arbitrary objects from user files
            sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"cannot read {path / 'pytorch_model.bin'}: {type(e).__name__}") from e
        return sd.get("state_dict", sd)
    raise ModelLoadError(f"no model.safetensors, *.safetensors or pytorch_model.bin in {path}")


def _head_config(d: dict, tensors: dict[str, torch.Tensor], target: ModelConfig) -> EagleHeadConfig:
    arch: Arch = "eagle3" if any(k.startswith("midlayer.") for k in tensors) else "eagle1"
    if arch == "eagle1" and any(k.startswith("layers.1.") for k in tensors):
        raise ModelLoadError("EAGLE heads with more than one decoder layer are not supported")
    d = {"model_type": "llama", "num_hidden_layers": 1, **d}
    d["model_type"] = d["model_type"] if d["model_type"] in ("llama", "qwen2", "mistral") else "llama"
    try:
        layer = replace(ModelConfig.from_hf_dict(d), num_layers=1)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"bad EAGLE head config.json: {e}") from e
    if d.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ModelLoadError(
            f"EAGLE head vocab_size {d['vocab_size']} != target vocab_size {target.vocab_size}"
        )
    if layer.hidden_size != target.hidden_size and arch == "eagle1":
        raise ModelLoadError(
            f"EAGLE head hidden_size {layer.hidden_size} != target hidden_size {target.hidden_size}"
        )
    aux: tuple[int, ...] = ()
    draft_vocab = 0
    if arch == "eagle3":
        eagle = d.get("eagle_config") or {}
        aux = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers))
        draft_vocab = int(d.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
        if bad := [i for i in aux if not 0 <= i < target.num_layers]:
            raise ModelLoadError(
                f"EAGLE-3 aux layer {bad[0]} out of range for a {target.num_layers}-layer target"
            )
    return EagleHeadConfig(
        arch=arch,
        layer=layer,
        target_hidden_size=int(d.get("target_hidden_size") or target.hidden_size),
        target_vocab_size=target.vocab_size,
        fc_bias="fc.bias" in tensors,
        aux_layers=aux,
        draft_vocab_size=draft_vocab,
    )


def head_aux_layers(path: str | Path, target_config: ModelConfig) -> tuple[int, ...]:
    """The target layers whose taps a head needs as features (empty for EAGLE-1)."""
    path = Path(path)
    d = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return _head_config(d, _tensors(path), target_config).aux_layers


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in _read_tensors(path).items()}


def load_eagle_head(
    path: str | Path,
    target_config: ModelConfig,
    target_weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> EagleHead:
    """Load a head directory (config.json + safetensors or pytorch_model.bin) for a given target.

    target_weights: at least "model.embed_tokens.weight" and, for untied targets, "lm_head.weight" (see
    shared_target_weights). max_positions sizes the RoPE table (default: the target's context).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"EAGLE head directory {str(path)!r} has no config.json")
    try:
        d = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"bad JSON in {path / 'config.json'}: {e}") from e
    tensors = _tensors(path)
    config = _head_config(d, tensors, target_config)
    head = EagleHead(
        config, target_weights, dtype, device, max_positions or target_config.max_position_embeddings
    )
    head.load_published(tensors)
    head.requires_grad_(False)
    return head


def _grow(head: EagleHead, layer: ModelConfig, target_weights: dict[str, torch.Tensor], seed: int,
          inputs: dict[str, int], output: str, old_columns: int) -> EagleHead:
    """A head of the same kind with its decoder layer grown to `layer`, computing what `head` computes: the
    trained weights keep their places, each new unit's input rows (`inputs`: weight name -> the trained
    rows) come from a fresh head as init_weights draws them, and its columns of `output` are zero, so the new
    units add nothing until training moves them."""
    c = head.config
    wide = EagleHead(replace(c, layer=layer), target_weights, head.dtype, head.device, head.cos_sin.shape[0])
    wide.init_weights(seed)
    prefix = "layers.0." if c.arch == "eagle1" else "midlayer."
    sd, fresh = head.published_state_dict(), wide.published_state_dict()
    for name, rows in inputs.items():
        key = f"{prefix}{name}.weight"
        sd[key] = torch.cat([sd[key], fresh[key][rows:]])
    key = f"{prefix}{output}.weight"
    sd[key] = torch.cat([sd[key], torch.zeros_like(fresh[key][:, old_columns:])], dim=1)
    wide.load_published(sd)
    return wide


@torch.no_grad()
def widen_mlp(head: EagleHead, intermediate_size: int, target_weights: dict[str, torch.Tensor],
              seed: int = 0) -> EagleHead:
    """The same head with a wider MLP that computes the same function, to grow a trained head's capacity and
    train on from it: the new gate and up rows start random, the new down_proj columns at zero."""
    old = head.config.layer.intermediate_size
    if intermediate_size < old:
        raise ValueError(f"an MLP of {old} cannot widen to {intermediate_size}")
    layer = replace(head.config.layer, intermediate_size=intermediate_size)
    return _grow(head, layer, target_weights, seed, {"mlp.gate_proj": old, "mlp.up_proj": old},
                 "mlp.down_proj", old)


def with_attention_heads(layer: ModelConfig, num_heads: int) -> ModelConfig:
    """`layer` with `num_heads` query heads and as many key/value heads as keep its grouping."""
    group = layer.num_heads // layer.num_kv_heads  # query heads per key/value head
    if num_heads < 1 or num_heads % group:
        raise ValueError(f"attention heads come in groups of {group} (to a key/value head), got {num_heads}")
    return replace(layer, num_heads=num_heads, num_kv_heads=num_heads // group)


@torch.no_grad()
def widen_attention(head: EagleHead, num_heads: int, target_weights: dict[str, torch.Tensor],
                    seed: int = 0) -> EagleHead:
    """The same head with more attention heads, computing the same function: the new query heads come after
    the old ones with new key/value heads of their own (the old query-to-key/value grouping unchanged), their
    projections random and their o_proj columns at zero. The format stays the published one
    (num_attention_heads, num_key_value_heads)."""
    layer = head.config.layer
    if num_heads < layer.num_heads:
        raise ValueError(f"{layer.num_heads} attention heads cannot widen to {num_heads}")
    q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    inputs = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows}
    return _grow(head, with_attention_heads(layer, num_heads), target_weights, seed, inputs,
                 "self_attn.o_proj", q_rows)


@torch.no_grad()
def grow_draft_vocab(head: EagleHead, draft_to_target: torch.Tensor,
                     target_weights: dict[str, torch.Tensor]) -> EagleHead:
    """The same EAGLE-3 head over a larger draft vocabulary (target ids, ascending), to raise the share of
    the target's distribution a draft can land on and train on from it. Old tokens that stay keep
    their trained output rows; a new token's row is the target's own output row for it, carried into the
    head's space by the least-squares linear map that takes the target's rows of the old tokens to their
    trained rows, so new tokens start with sensible logits instead of noise."""
    c = head.config
    if c.arch != "eagle3":
        raise ValueError("only EAGLE-3 heads have a draft vocabulary")
    old = head.draft_to_target.cpu()
    new = draft_to_target.cpu().long()
    if new.numel() < old.numel() or not bool((new[1:] > new[:-1]).all()):
        raise ValueError(f"a draft vocabulary of {old.numel()} grows only into more ascending target ids, "
                         f"got {new.numel()}")
    if int(new.max()) >= c.target_vocab_size or int(new.min()) < 0:
        raise ValueError(f"draft ids must map into the target vocabulary of {c.target_vocab_size}")
    target_rows = target_weights.get("lm_head.weight", target_weights["model.embed_tokens.weight"])
    target_rows = target_rows.float().cpu()
    trained = head.lm_head.weight.float().cpu()
    into_head = torch.linalg.lstsq(target_rows[old], trained).solution  # [H, H]
    rows = target_rows[new] @ into_head
    where_old = torch.full((c.target_vocab_size,), -1, dtype=torch.long)
    where_old[old] = torch.arange(old.numel())
    kept = where_old[new] >= 0
    rows[kept] = trained[where_old[new][kept]]
    grown = EagleHead(replace(c, draft_vocab_size=new.numel()), target_weights, head.dtype, head.device,
                      head.cos_sin.shape[0])
    sd = head.published_state_dict()
    sd["lm_head.weight"] = rows.to(head.dtype)
    sd["d2t"] = d2t_offsets(new)
    grown.load_published(sd)
    return grown


# draft_vocab_size of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json
RANDOM_DRAFT_VOCAB = 32_000


def random_eagle_head(
    target_config: ModelConfig,
    target_weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    seed: int = 0,
) -> EagleHead:
    """An EAGLE-3 head of the target's layer shape with random weights, for synthetic targets: its drafts cost
    what a trained head's do (the fc over three taps, one decoder layer, an lm_head over the draft
    vocabulary a step), their ids are noise. The draft vocabulary is that of the published EAGLE-3 head for
    Llama-3.1-8B-Instruct (its first RANDOM_DRAFT_VOCAB target ids)."""
    config = EagleHeadConfig.for_target(target_config, "eagle3", draft_vocab_size=RANDOM_DRAFT_VOCAB)
    head = EagleHead(config, target_weights, dtype, device, max_positions)
    head.init_weights(seed)
    return head.requires_grad_(False)


def save_eagle_head(
    head: EagleHead, path: str | Path, extra: dict | None = None, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write config.json (a Llama config, EAGLE keys added) and model.safetensors in the published format."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c, layer = head.config, head.config.layer
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if c.arch == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "rope_scaling": layer.rope_scaling,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "bias": c.fc_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
    }
    if c.arch == "eagle3":
        config["draft_vocab_size"] = c.draft_vocab_size
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)}
    config["specwire"] = {"arch": c.arch, **(extra or {})}
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
        for k, v in head.published_state_dict().items()
    }
    if c.arch == "eagle3":  # SpecForge writes t2d beside d2t; vLLM and SGLang skip it, we check it
        tensors["t2d"] = t2d_mask(head.draft_to_target, c.target_vocab_size).cpu()
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
