"""The one table of the decoder's weights: key path, logical axes (which give the shape), init,
the dtype the forward reads it in, the transformers tensor it maps to, and which models have it.

Everything that names a weight derives from `WEIGHTS`: the random init and the abstract
shapes (`models.api`), the sharding (`param_logical_axes` through `LOGICAL_AXIS_RULES`), the
checkpoint map (`models.hf_io`), the dtype of the weights the layers and the sampler read
(`Weight.stored_dtype`) and the parameter count (`ModelConfig.num_params`). The layer math
reads the same paths (`models.decoder`). A weight only some families have is a row whose `when`
reads the family's declaration (`models.families`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from rcgrpo_jax.models.config import ModelConfig

# The size of each logical weight axis (a field of ModelConfig); "layers" is the stacking axis.
DIMS = {
    "vocab": "vocab_size",
    "embed": "hidden_size",
    "norm": "hidden_size",
    "q_heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "mlp": "intermediate_size",
    "lora_rank": "lora_rank",  # LoRA's inner dimension (`LoraSpec.rank`)
    "lora_tokens": "lora_tokens",  # the embedding rows that train under LoRA (reward tokens)
}
Params = dict[str, Any]  # the param tree: nested dicts of arrays, keyed by `Weight.path`
LAYER = "model.layers.{i}."  # transformers' per-layer name prefix; "{i}" is the layer index


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight. Paths under "layers" are stacked: [num_layers, *shape], axis "layers"."""

    path: tuple[str, ...]
    axes: tuple[str, ...]  # logical axes, one per dimension (per layer for stacked weights)
    init: str  # "normal" (std 0.02) | "ones" | "zeros"
    hf_name: str
    # Which of our dimensions make up each dimension of the transformers tensor, in its order
    # (merged by reshape): q_proj [H*D, E] from our wq [E, H, D] is ((1, 2), (0,)).
    hf_dims: tuple[tuple[int, ...], ...]
    when: Callable[[ModelConfig], bool] = _always
    # True: the forward reads it in its stored (parameter) dtype, uncast; norm scales, which
    # `decoder.rms_norm` casts itself. False: cast to the compute dtype where it is used.
    stored_dtype: bool = False
    # A LoRA row (`ModelConfig.lora`): an adapter or a trainable token row. It trains where the
    # base is frozen, is kept in float32 whatever `param_dtype`, and a merged checkpoint folds it
    # into the base (`models.lora.merge`); its `hf_name` is PEFT's key in an adapter file.
    lora: bool = False

    @property
    def per_layer(self) -> bool:
        return self.path[0] == "layers"

    @property
    def name(self) -> str:
        return self.path[-1]

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The shape of one layer's weight (stacked weights add a leading num_layers)."""
        return tuple(getattr(cfg, DIMS[a]) for a in self.axes)

    def full_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return ((cfg.num_layers,) if self.per_layer else ()) + self.shape(cfg)

    def full_axes(self) -> tuple[str, ...]:
        return (("layers",) if self.per_layer else ()) + self.axes

    def dtype(self, cfg: ModelConfig) -> Any:
        """The parameter dtype it is kept in."""
        return jnp.float32 if self.lora else cfg.weight_dtype


def _qkv_bias(cfg: ModelConfig) -> bool:
    return cfg.qkv_bias


def _untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_embeddings


def _qk_norm(cfg: ModelConfig) -> bool:
    return cfg.family_spec.qk_norm


def _token_rows(cfg: ModelConfig) -> bool:
    return cfg.lora_tokens > 0


def _token_cols(cfg: ModelConfig) -> bool:
    return cfg.lora_tokens > 0 and not cfg.tie_embeddings


_SAME1, _SAME2, _T2 = ((0,),), ((0,), (1,)), ((1,), (0,))
_HEADS_IN, _HEADS_OUT, _BIAS = ((1, 2), (0,)), ((2,), (0, 1)), ((0, 1),)
_ATT, _MLP = ("layers", "attn"), ("layers", "mlp")

# In declaration order: the random init draws each scope's weights in this order.
WEIGHTS: tuple[Weight, ...] = (
    Weight(("embedding",), ("vocab", "embed"), "normal", "model.embed_tokens.weight", _SAME2),
    Weight((*_ATT, "wq"), ("embed", "q_heads", "head_dim"), "normal",
           LAYER + "self_attn.q_proj.weight", _HEADS_IN),
    Weight((*_ATT, "wk"), ("embed", "kv_heads", "head_dim"), "normal",
           LAYER + "self_attn.k_proj.weight", _HEADS_IN),
    Weight((*_ATT, "wv"), ("embed", "kv_heads", "head_dim"), "normal",
           LAYER + "self_attn.v_proj.weight", _HEADS_IN),
    Weight((*_ATT, "wo"), ("q_heads", "head_dim", "embed"), "normal",
           LAYER + "self_attn.o_proj.weight", _HEADS_OUT),
    Weight(("layers", "attn_norm", "scale"), ("norm",), "ones",
           LAYER + "input_layernorm.weight", _SAME1, stored_dtype=True),
    Weight(("layers", "mlp_norm", "scale"), ("norm",), "ones",
           LAYER + "post_attention_layernorm.weight", _SAME1, stored_dtype=True),
    Weight((*_MLP, "w_gate"), ("embed", "mlp"), "normal", LAYER + "mlp.gate_proj.weight", _T2),
    Weight((*_MLP, "w_up"), ("embed", "mlp"), "normal", LAYER + "mlp.up_proj.weight", _T2),
    Weight((*_MLP, "w_down"), ("mlp", "embed"), "normal", LAYER + "mlp.down_proj.weight", _T2),
    Weight(("final_norm", "scale"), ("norm",), "ones", "model.norm.weight", _SAME1,
           stored_dtype=True),
    Weight((*_ATT, "bq"), ("q_heads", "head_dim"), "zeros",
           LAYER + "self_attn.q_proj.bias", _BIAS, _qkv_bias),
    Weight((*_ATT, "bk"), ("kv_heads", "head_dim"), "zeros",
           LAYER + "self_attn.k_proj.bias", _BIAS, _qkv_bias),
    Weight((*_ATT, "bv"), ("kv_heads", "head_dim"), "zeros",
           LAYER + "self_attn.v_proj.bias", _BIAS, _qkv_bias),
    # Qwen3's per-head q/k norms; leaves named "scale", like every norm's, so that the
    # optimizer's no-decay rule (`train.optim.NO_DECAY_NAMES`, by leaf name) covers them.
    Weight((*_ATT, "q_norm", "scale"), ("head_dim",), "ones",
           LAYER + "self_attn.q_norm.weight", _SAME1, _qk_norm, stored_dtype=True),
    Weight((*_ATT, "k_norm", "scale"), ("head_dim",), "ones",
           LAYER + "self_attn.k_norm.weight", _SAME1, _qk_norm, stored_dtype=True),
    Weight(("lm_head",), ("embed", "vocab"), "normal", "lm_head.weight", _T2, _untied),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A projection LoRA can adapt: its short name (`LoraSpec.targets`), our weight's path, the
    transformers module it is, and how many of its leading axes are its input."""

    name: str
    path: tuple[str, ...]
    module: str
    n_in: int


LORA_TARGETS: tuple[LoraTarget, ...] = (
    LoraTarget("q", (*_ATT, "wq"), "self_attn.q_proj", 1),
    LoraTarget("k", (*_ATT, "wk"), "self_attn.k_proj", 1),
    LoraTarget("v", (*_ATT, "wv"), "self_attn.v_proj", 1),
    LoraTarget("o", (*_ATT, "wo"), "self_attn.o_proj", 2),
    LoraTarget("gate", (*_MLP, "w_gate"), "mlp.gate_proj", 1),
    LoraTarget("up", (*_MLP, "w_up"), "mlp.up_proj", 1),
    LoraTarget("down", (*_MLP, "w_down"), "mlp.down_proj", 1),
)
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM's modules


def _targeted(name: str) -> Callable[[ModelConfig], bool]:
    return lambda cfg: cfg.lora is not None and name in cfg.lora.targets


def _lora_rows(t: LoraTarget) -> tuple[Weight, Weight]:
    """A [in..., rank] and B [rank, out...] of one target: A has the adapted weight's input axes,
    B its output axes, so both shard like the rows they adapt. In PEFT's file, torch Linear
    layouts: lora_A [rank, in], lora_B [out, rank]."""
    base = next(w for w in WEIGHTS if w.path == t.path)
    n_out = len(base.axes) - t.n_in
    name = PEFT_PREFIX + LAYER + t.module + ".lora_"
    scope = (*t.path[:-1], f"{t.path[-1]}_lora")
    a = Weight(
        (*scope, "a"),
        (*base.axes[: t.n_in], "lora_rank"),
        "lora_a",
        name + "A.weight",
        ((t.n_in,), tuple(range(t.n_in))),
        _targeted(t.name),
        lora=True,
    )
    b = Weight(
        (*scope, "b"),
        ("lora_rank", *base.axes[t.n_in :]),
        "zeros",
        name + "B.weight",
        (tuple(range(1, 1 + n_out)), (0,)),
        _targeted(t.name),
        lora=True,
    )
    return a, b  # fmt: skip


# The trainable token rows (PEFT's `trainable_token_indices`: whole rows, not deltas, in spite
# of PEFT's key name): the embedding's rows of `LoraSpec.token_ids` and, untied, the head's
# columns of them. Initialised as copies of the base's ("copy", `models.lora.attach`).
_TOKENS = "token_adapter.trainable_tokens_delta"
LORA_WEIGHTS: tuple[Weight, ...] = (
    *(w for t in LORA_TARGETS for w in _lora_rows(t)),
    Weight(("lora_tokens", "embedding"), ("lora_tokens", "embed"), "copy",
           f"{PEFT_PREFIX}model.embed_tokens.{_TOKENS}", _SAME2, _token_rows, lora=True),
    Weight(("lora_tokens", "lm_head"), ("embed", "lora_tokens"), "copy",
           f"{PEFT_PREFIX}lm_head.{_TOKENS}", _T2, _token_cols, lora=True),
)  # fmt: skip


def weights(cfg: ModelConfig) -> list[Weight]:
    """The weights a model with this config has, LoRA's rows (if any) after the base's."""
    return [w for w in (*WEIGHTS, *LORA_WEIGHTS) if w.when(cfg)]


def base_weights(cfg: ModelConfig) -> list[Weight]:
    """The base model's weights: what a transformers checkpoint holds."""
    return [w for w in WEIGHTS if w.when(cfg)]


def num_params(cfg: ModelConfig) -> int:
    """The base model's parameter count (LoRA's rows: `num_lora_params`)."""
    return sum(math.prod(w.full_shape(cfg)) for w in base_weights(cfg))


def num_lora_params(cfg: ModelConfig) -> int:
    return sum(math.prod(w.full_shape(cfg)) for w in weights(cfg) if w.lora)


def nest(items: Iterable[tuple[tuple[str, ...], Any]]) -> Params:
    """A param-shaped tree of nested dicts from (path, leaf) pairs."""
    out: Params = {}
    for path, leaf in items:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


def lookup(tree: Params, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def table(cfg: ModelConfig) -> Params:
    """The `Weight` of each leaf, in a param-shaped tree (for tree maps beside the params)."""
    return nest((w.path, w) for w in weights(cfg))


def logical_axes(cfg: ModelConfig) -> Params:
    """Logical-axis tuples, one per weight (stacked weights start with "layers")."""
    return nest((w.path, w.full_axes()) for w in weights(cfg))


def shapes(cfg: ModelConfig) -> Params:
    """Abstract params: ShapeDtypeStruct leaves in the parameter dtype."""
    return nest(
        (w.path, jax.ShapeDtypeStruct(w.full_shape(cfg), w.dtype(cfg))) for w in weights(cfg)
    )


def is_axes(x: Any) -> bool:
    """A leaf of `logical_axes` (for tree maps over it)."""
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)
