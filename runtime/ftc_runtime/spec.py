"""The model spec: the shapes and rules of one MoE model, as frozen dataclasses.

The compiler reads a spec from YAML or from an HF `config.json`; the runtime reads it back from
`engine.json`. Both go through `ModelSpec.from_dict`, which checks every field and names the field,
the value and what was expected when something is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from ftc_runtime.formats import FORMATS, expert_format

DENSE_FORMATS = ("bf16", "fp8")

LAYER_KINDS = ("full_attention", "linear_attention")
COMPRESSED_LAYER_TYPES = ("sliding", "csa", "hca")  # DeepSeek-V4's attention per layer

# Upper bounds of the size fields: an engine.json or spec that is damaged or hostile must not make the
# loader allocate or loop without limit. Each is several times the largest model in view: GLM-5 and
# DeepSeek-V4 (750B-class: under 100 layers, 256-384 experts, hidden 6144-7168, vocab under 2^18,
# 128 heads, expert intermediate 2048), dense MLPs of 405B-class models (intermediate 53248), and
# million-token contexts.
MAX_LAYERS = 1024
MAX_HIDDEN = 65536
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_EXPERTS = 4096
MAX_TOP_K = 256
MAX_INTERMEDIATE = 1 << 17
MAX_POSITIONS = 1 << 24
MAX_CONV_KERNEL = 64
MAX_MTP_LAYERS = 8  # the releases have one
MAX_NAME = 255  # the default output directory is build/<name>: one file name


class SpecError(ValueError):
    """A spec field has a wrong or missing value; the message names the field and the value."""


@dataclass(frozen=True)
class NormSpec:
    # "rms": w · x̂; "rms_one_plus": (1 + w) · x̂ (Qwen3-Next / Qwen3.5, weights stored around 0)
    kind: Literal["rms", "rms_one_plus"] = "rms"
    eps: float = 1e-6


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kind: str = "gqa"
    qk_norm: bool = True
    bias: bool = False
    # q_proj also yields a per-channel gate: output · sigmoid(gate) before o_proj (Qwen3-Next).
    output_gate: bool = False


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers (`layer_kinds` entries "linear_attention")."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (`attention.kind` "mla", GLM-5 and DeepSeek): queries through a
    low-rank `q_lora_rank`, keys and values from one `kv_lora_rank` latent per token plus a
    `rope_dim` rotary key shared by the heads, which is all the cache keeps; per head `nope_dim` +
    `rope_dim` query/key dims and `v_dim` value dims (`attention.head_dim` is nope_dim + rope_dim).
    `softmax_scale`: 0 for (nope_dim + rope_dim)^-0.5, else that factor as the config gives it."""

    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    softmax_scale: float = 0.0


@dataclass(frozen=True)
class IndexerSpec:
    """The DSA indexer of sparse attention: per query the `top_k` cached tokens with the highest
    index scores (`num_heads` heads of `head_dim`); `layer_types` per layer: "full" layers run it,
    "shared" ones reuse the previous full layer's choice."""

    num_heads: int
    head_dim: int
    top_k: int
    layer_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class YarnSpec:
    """YaRN's stretch of a rotary base to longer contexts: the frequencies below the original
    context's are divided by `factor`, those above kept, a linear ramp between the wavelengths
    that make `beta_fast` and `beta_slow` turns over `original_max_position`."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """DeepSeek-V4's attention (`attention.kind` "compressed"): `attention.num_heads` query heads
    against one shared key/value head of `attention.head_dim` (its last `rope_dim` channels rotated
    in interleaved pairs), queries through a `q_lora_rank` path, a learned sink logit per head, and
    a grouped output projection (`o_groups` groups of heads, each to `o_lora_rank`). Every layer
    attends the last `sliding_window` tokens' raw entries; `layer_types` per layer adds compressed
    entries: "csa" one per `csa_rate` tokens (overlapping windows) of which the lightning indexer
    (`index_heads` × `index_head_dim`) picks `index_top_k`, "hca" one per `hca_rate` tokens, all
    seen, "sliding" none. Compressed entries rotate at base `compress_theta`, stretched by
    `compress_yarn` where set; the raw ones at `rope.theta`."""

    q_lora_rank: int
    rope_dim: int
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    compress_theta: float
    compress_yarn: YarnSpec | None = None
    csa_rate: int = 4
    hca_rate: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_top_k: int = 512


@dataclass(frozen=True)
class HyperConnectionSpec:
    """Manifold-constrained hyper-connections (DeepSeek-V4): the residual as `streams` streams, mixed
    before each block by a matrix made doubly stochastic in `sinkhorn_iters` steps (floor `eps`)."""

    streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 1_000_000.0
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    # Layers that use a dense MLP instead of experts (HF `mlp_only_layers` / `decoder_sparse_step`).
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    # router "sigmoid_topk" (GLM-5, DeepSeek-V3): experts chosen by sigmoid scores plus a learned
    # bias, within the best `topk_group` of `n_group` groups; weights × routed_scaling_factor.
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # router "sqrt_softplus_topk" (DeepSeek-V4): scores sqrt(softplus(W x)) chosen with a learned
    # bias, except in `hash_layers`, which take a fixed row of experts per token id (`tid2eid`).
    hash_layers: tuple[int, ...] = ()
    # The experts' gate and up pre-activations clamped to this magnitude (the gate from above
    # only); 0: not clamped.
    swiglu_limit: float = 0.0


@dataclass(frozen=True)
class TokenSpec:
    """Special tokens by text → id; `eos` and `boundaries` name some of them."""

    special: dict[str, int] = field(default_factory=dict)
    eos: tuple[str, ...] = ()
    bos: str | None = None
    # Agent-edit boundaries (end of reasoning, tool call, tool output, turn) used by later issues.
    boundaries: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # a key of ftc_runtime.models.FAMILIES, whose rules `models.checked_spec` applies
    num_layers: int
    hidden_size: int
    vocab_size: int
    attention: AttentionSpec
    moe: MoESpec
    norm: NormSpec = NormSpec()
    rope: RopeSpec = RopeSpec()
    tokens: TokenSpec = TokenSpec()
    # One entry per layer; empty means every layer is "full_attention". Hybrid families list
    # their linear-attention layers here.
    layer_kinds: tuple[str, ...] = ()
    linear_attention: LinearAttentionSpec | None = None
    mla: MlaSpec | None = None  # where attention.kind is "mla"
    indexer: IndexerSpec | None = None  # sparse attention's indexer, where the family has one
    compressed: CompressedAttentionSpec | None = None  # where attention.kind is "compressed"
    hyper_connections: HyperConnectionSpec | None = None  # a residual of several streams, where set
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    expert_format: str = "bf16"  # how the routed experts are stored: a module of ftc_runtime.formats
    # How the non-expert linear projections are held: bf16, or fp8 (e4m3 codes and an fp32 scale per
    # 128 × 128 block, as FP8 releases store them) in the families that read them so.
    dense_format: str = "bf16"
    checkpoint: str | None = None
    # Multi-token-prediction layers after the last decoder layer (the checkpoint's MTP or next-n
    # heads: `--speculate mtp:K` drafts with them): decoder layers num_layers .. num_layers +
    # mtp_layers - 1, each full attention with routed experts, which the pool holds after the others'.
    mtp_layers: int = 0

    # -- derived ---------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder layer indices that have routed experts, in order (FTW layer l is the l-th)."""
        dense = set(self.moe.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def mtp_decoder_layers(self) -> tuple[int, ...]:
        """The multi-token-prediction layers' decoder indices (after the model's own)."""
        return tuple(range(self.num_layers, self.num_layers + self.mtp_layers))

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The decoder layers whose routed experts the pool holds, in its order: the MoE layers,
        then the multi-token-prediction layers."""
        return self.moe_layers + self.mtp_decoder_layers

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Decoder layers with softmax attention (and a KV cache), in order."""
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.layer_kind(i) == "linear_attention")

    def layer_kind(self, i: int) -> str:
        """A decoder layer's token mixer; a multi-token-prediction layer's is full attention."""
        return self.layer_kinds[i] if self.layer_kinds and i < self.num_layers else "full_attention"

    @property
    def resumes_at_checkpoints(self) -> bool:
        """A sequence's state replaces its past in some layers (Gated DeltaNet's recurrence,
        compressed attention's windows): it resumes only where a checkpoint holds that state."""
        return bool(self.linear_attention_layers) or self.attention.kind == "compressed"

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate, up and down, and scales where its format has them)."""
        return expert_format(self.expert_format).expert_bytes(self.hidden_size, self.moe.expert_intermediate_size)

    def token_id(self, text: str) -> int:
        return self.tokens.special[text]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokens.special[t] for t in self.tokens.eos)

    # -- (de)serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "spec") -> ModelSpec:
        spec = from_plain(cls, data, source)
        _check(spec, source)
        return spec


def from_plain(cls: type, data: Any, source: str) -> Any:
    """The dataclass `cls` from plain data (parsed YAML or JSON), every field converted by its type
    hint; a missing, unknown or mistyped field is a SpecError naming the field and the value."""
    return _build(cls, data, source, "")


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _fail(source: str, path: str, value: Any, expected: str) -> SpecError:
    return SpecError(f"{source}: field '{path}' = {short_repr(value)}: expected {expected}")


def short_repr(value: Any, limit: int = 120) -> str:
    """repr(value), cut to `limit` characters: a damaged file's megabyte string stays out of the message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "(top level)"
    if not isinstance(data, dict):
        raise _fail(source, where, data, f"a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(data) - set(fields))  # YAML keys may be numbers
    if unknown:
        raise SpecError(f"{source}: unknown field {short_repr(prefix + unknown[0])}; "
                        f"{where} takes: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        path = prefix + name
        if name not in data:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise SpecError(f"{source}: missing required field '{path}'")
            continue
        kwargs[name] = _convert(hints[name], data[name], source, path)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, path + ".")
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, source, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise _fail(source, path, value, "one of " + ", ".join(map(repr, get_args(tp))))
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail(source, path, value, "a list")
        return tuple(_convert(get_args(tp)[0], v, source, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(source, path, value, "a mapping")
        kt, vt = get_args(tp)
        return {_convert(kt, k, source, path): _convert(vt, v, source, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(source, path, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(source, path, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(source, path, value, "a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(source, path, value, "a string")
        return value
    raise TypeError(f"spec field {path} has unsupported type {tp}")


def checker(source: str) -> Need:
    """The `need(ok, field, value, expected)` of the rules on a spec from `source`."""

    def need(ok: bool, path: str, value: Any, expected: str) -> None:
        if not ok:
            raise _fail(source, path, value, expected)

    return need


def _check(s: ModelSpec, source: str) -> None:
    """Cross-field rules that hold in every family; each names the field that breaks it."""
    need = checker(source)
    a, m = s.attention, s.moe
    need(s.expert_format in FORMATS, "expert_format", s.expert_format, "one of " + ", ".join(FORMATS))
    need(s.dense_format in DENSE_FORMATS, "dense_format", s.dense_format, "one of " + ", ".join(DENSE_FORMATS))
    step = expert_format(s.expert_format).size_multiple
    for path, n in (("hidden_size", s.hidden_size), ("moe.expert_intermediate_size", m.expert_intermediate_size)):
        need(n % step == 0, path, n, f"a multiple of {step} for expert_format {s.expert_format}")
    # The default engine directory is build/<name>: a name that is not one plain file name would put it elsewhere.
    plain = 0 < len(s.name) <= MAX_NAME and s.name not in (".", "..") and not any(c in s.name for c in "/\\\0")
    need(plain, "name", s.name, f"a plain file name of at most {MAX_NAME} characters (no '/', '\\', '.' or '..')")
    _check_sizes(s, need)
    need(a.num_heads % a.num_kv_heads == 0, "attention.num_kv_heads", a.num_kv_heads,
         f"a divisor of attention.num_heads ({a.num_heads})")
    need(a.head_dim % 2 == 0, "attention.head_dim", a.head_dim, "an even number (RoPE pairs)")
    need(m.top_k <= m.num_experts, "moe.top_k", m.top_k, f"at most moe.num_experts ({m.num_experts})")
    _check_groups(m, need)
    need(0 < s.norm.eps < 1, "norm.eps", s.norm.eps, "a number in (0, 1)")
    need(0 < s.rope.theta < math.inf, "rope.theta", s.rope.theta, "a positive finite number")
    need(0 < s.rope.partial_rotary_factor <= 1, "rope.partial_rotary_factor",
         s.rope.partial_rotary_factor, "a number in (0, 1]")
    for i, layer in enumerate(m.dense_layers):
        need(0 <= layer < s.num_layers, f"moe.dense_layers[{i}]", layer, f"a layer in [0, {s.num_layers})")
    if m.dense_layers:
        need(m.dense_intermediate_size > 0, "moe.dense_intermediate_size", m.dense_intermediate_size,
             "a positive integer when moe.dense_layers is not empty")
    need(len(s.moe_layers) > 0, "moe.dense_layers", list(m.dense_layers), "at least one layer with experts")
    if s.layer_kinds:
        need(len(s.layer_kinds) == s.num_layers, "layer_kinds", len(s.layer_kinds),
             f"one entry per layer ({s.num_layers})")
        for i, k in enumerate(s.layer_kinds):
            need(k in LAYER_KINDS, f"layer_kinds[{i}]", k, "one of " + ", ".join(LAYER_KINDS))
    _check_linear_attention(s, need)
    _check_mla(s, need)
    _check_compressed(s, need)
    _check_hyper_connections(s, need)
    for i, layer in enumerate(m.hash_layers):
        need(0 <= layer < s.num_layers, f"moe.hash_layers[{i}]", layer, f"a layer in [0, {s.num_layers})")
    need(0 <= m.swiglu_limit < math.inf, "moe.swiglu_limit", m.swiglu_limit, "0 (no clamp) or a positive number")
    need(len(s.full_attention_layers) > 0, "layer_kinds", list(s.layer_kinds), "at least one full_attention layer")
    _check_tokens(s, need)


def _check_linear_attention(s: ModelSpec, need: Need) -> None:
    la = s.linear_attention
    if not s.linear_attention_layers:
        return
    need(la is not None, "linear_attention", la, "the Gated DeltaNet shapes (layer_kinds has linear layers)")
    for path, v, top in (("linear_attention.num_k_heads", la.num_k_heads, MAX_HEADS),
                         ("linear_attention.num_v_heads", la.num_v_heads, MAX_HEADS),
                         ("linear_attention.k_head_dim", la.k_head_dim, MAX_HEAD_DIM),
                         ("linear_attention.v_head_dim", la.v_head_dim, MAX_HEAD_DIM),
                         ("linear_attention.conv_kernel", la.conv_kernel, MAX_CONV_KERNEL)):
        _bounded(need, path, v, 1, top)
    need(la.num_v_heads % la.num_k_heads == 0, "linear_attention.num_v_heads", la.num_v_heads,
         f"a multiple of linear_attention.num_k_heads ({la.num_k_heads})")


def _check_groups(m: MoESpec, need: Need) -> None:
    """The sigmoid router's expert groups and scale."""
    for path, v, top in (("moe.n_group", m.n_group, m.num_experts), ("moe.topk_group", m.topk_group, m.n_group)):
        _bounded(need, path, v, 1, top)
    need(m.num_experts % m.n_group == 0, "moe.n_group", m.n_group, f"a divisor of moe.num_experts ({m.num_experts})")
    need(m.top_k <= m.topk_group * (m.num_experts // m.n_group), "moe.topk_group", m.topk_group,
         f"enough groups for moe.top_k ({m.top_k}) experts")
    need(0 < m.routed_scaling_factor < math.inf, "moe.routed_scaling_factor", m.routed_scaling_factor,
         "a positive finite number")


def _check_mla(s: ModelSpec, need: Need) -> None:
    a, ml = s.attention, s.mla
    if a.kind != "mla":
        need(ml is None, "mla", ml, "no latent attention shapes unless attention.kind is 'mla'")
        need(s.indexer is None, "indexer", s.indexer, "no sparse-attention indexer unless attention.kind is 'mla'")
        return
    need(ml is not None, "mla", ml, "the latent attention's shapes (attention.kind is 'mla')")
    for path, v in (("mla.q_lora_rank", ml.q_lora_rank), ("mla.kv_lora_rank", ml.kv_lora_rank),
                    ("mla.nope_dim", ml.nope_dim), ("mla.rope_dim", ml.rope_dim), ("mla.v_dim", ml.v_dim)):
        _bounded(need, path, v, 1, MAX_HIDDEN)
    need(ml.rope_dim % 2 == 0, "mla.rope_dim", ml.rope_dim, "an even number (RoPE pairs)")
    need(a.head_dim == ml.nope_dim + ml.rope_dim, "attention.head_dim", a.head_dim,
         f"mla.nope_dim + mla.rope_dim ({ml.nope_dim + ml.rope_dim})")
    need(0 <= ml.softmax_scale < math.inf, "mla.softmax_scale", ml.softmax_scale,
         "0 (the default) or a positive number")
    if s.indexer is not None:
        _check_indexer(s, s.indexer, need)


def _check_compressed(s: ModelSpec, need: Need) -> None:
    a, c = s.attention, s.compressed
    if a.kind != "compressed":
        need(c is None, "compressed", c, "no compressed attention unless attention.kind is 'compressed'")
        return
    need(c is not None, "compressed", c, "the compressed attention's shapes (attention.kind is 'compressed')")
    need(a.num_kv_heads == 1, "attention.num_kv_heads", a.num_kv_heads, "1 (one shared key/value head)")
    for path, v, top in (("compressed.q_lora_rank", c.q_lora_rank, MAX_HIDDEN),
                         ("compressed.rope_dim", c.rope_dim, a.head_dim),
                         ("compressed.sliding_window", c.sliding_window, MAX_POSITIONS),
                         ("compressed.o_groups", c.o_groups, a.num_heads),
                         ("compressed.o_lora_rank", c.o_lora_rank, MAX_HIDDEN),
                         ("compressed.csa_rate", c.csa_rate, MAX_POSITIONS),
                         ("compressed.hca_rate", c.hca_rate, MAX_POSITIONS),
                         ("compressed.index_heads", c.index_heads, MAX_HEADS),
                         ("compressed.index_head_dim", c.index_head_dim, MAX_HEAD_DIM),
                         ("compressed.index_top_k", c.index_top_k, MAX_POSITIONS)):
        _bounded(need, path, v, 1, top)
    need(c.rope_dim % 2 == 0, "compressed.rope_dim", c.rope_dim, "an even number (RoPE pairs)")
    need(a.num_heads % c.o_groups == 0, "compressed.o_groups", c.o_groups,
         f"a divisor of attention.num_heads ({a.num_heads})")
    need(c.index_head_dim >= c.rope_dim, "compressed.index_head_dim", c.index_head_dim,
         f"at least compressed.rope_dim ({c.rope_dim})")
    need(0 < c.compress_theta < math.inf, "compressed.compress_theta", c.compress_theta, "a positive finite number")
    need(len(c.layer_types) == s.num_layers, "compressed.layer_types", len(c.layer_types),
         f"one entry per layer ({s.num_layers})")
    for i, kind in enumerate(c.layer_types):
        need(kind in COMPRESSED_LAYER_TYPES, f"compressed.layer_types[{i}]", kind,
             "one of " + ", ".join(COMPRESSED_LAYER_TYPES))
    y = c.compress_yarn
    if y is not None:
        need(1 <= y.factor < math.inf, "compressed.compress_yarn.factor", y.factor, "a finite number of at least 1")
        _bounded(need, "compressed.compress_yarn.original_max_position", y.original_max_position, 1, MAX_POSITIONS)


def _check_hyper_connections(s: ModelSpec, need: Need) -> None:
    hc = s.hyper_connections
    if hc is None:
        return
    _bounded(need, "hyper_connections.streams", hc.streams, 1, 64)
    _bounded(need, "hyper_connections.sinkhorn_iters", hc.sinkhorn_iters, 1, 1000)
    need(0 < hc.eps < 1, "hyper_connections.eps", hc.eps, "a number in (0, 1)")


def _check_indexer(s: ModelSpec, ix: IndexerSpec, need: Need) -> None:
    ml = s.mla
    for path, v, top in (("indexer.num_heads", ix.num_heads, MAX_HEADS),
                         ("indexer.head_dim", ix.head_dim, MAX_HEAD_DIM), ("indexer.top_k", ix.top_k, MAX_POSITIONS)):
        _bounded(need, path, v, 1, top)
    need(ix.head_dim >= ml.rope_dim, "indexer.head_dim", ix.head_dim, f"at least mla.rope_dim ({ml.rope_dim})")
    need(len(ix.layer_types) == s.num_layers, "indexer.layer_types", len(ix.layer_types),
         f"one entry per layer ({s.num_layers})")
    for i, kind in enumerate(ix.layer_types):
        need(kind in ("full", "shared"), f"indexer.layer_types[{i}]", kind, "'full' or 'shared'")
    if ix.layer_types:
        need(ix.layer_types[0] == "full", "indexer.layer_types[0]", ix.layer_types[0],
             "'full' (a shared layer reuses an earlier full layer's choice)")


def _check_tokens(s: ModelSpec, need: Need) -> None:
    for text, tid in s.tokens.special.items():
        need(0 <= tid < s.vocab_size, f"tokens.special.{text}", tid, f"an id in [0, vocab_size={s.vocab_size})")
    for i, text in enumerate(s.tokens.eos):
        need(text in s.tokens.special, f"tokens.eos[{i}]", text, "a token listed in tokens.special")
    for i, text in enumerate(s.tokens.boundaries):
        need(text in s.tokens.special, f"tokens.boundaries[{i}]", text, "a token listed in tokens.special")
    if s.tokens.bos is not None:
        need(s.tokens.bos in s.tokens.special, "tokens.bos", s.tokens.bos, "a token listed in tokens.special")


Need = Callable[[bool, str, Any, str], None]  # raises the SpecError naming (field, value, expected) unless ok


def _check_sizes(s: ModelSpec, need: Need) -> None:
    """Every size within its bound, before any rule loops over one (a damaged num_layers of 10^9
    must not build a 10^9-entry tuple first)."""
    a, m = s.attention, s.moe
    for path, v, low, top in (
        ("num_layers", s.num_layers, 1, MAX_LAYERS), ("hidden_size", s.hidden_size, 1, MAX_HIDDEN),
        ("vocab_size", s.vocab_size, 1, MAX_VOCAB), ("attention.num_heads", a.num_heads, 1, MAX_HEADS),
        ("attention.num_kv_heads", a.num_kv_heads, 1, MAX_HEADS), ("attention.head_dim", a.head_dim, 1, MAX_HEAD_DIM),
        ("moe.num_experts", m.num_experts, 1, MAX_EXPERTS), ("moe.top_k", m.top_k, 1, MAX_TOP_K),
        ("moe.expert_intermediate_size", m.expert_intermediate_size, 1, MAX_INTERMEDIATE),
        ("moe.num_shared_experts", m.num_shared_experts, 0, MAX_EXPERTS),
        ("moe.shared_expert_intermediate_size", m.shared_expert_intermediate_size, 0, MAX_INTERMEDIATE),
        ("moe.dense_intermediate_size", m.dense_intermediate_size, 0, MAX_INTERMEDIATE),
        ("max_position_embeddings", s.max_position_embeddings, 1, MAX_POSITIONS),
        ("mtp_layers", s.mtp_layers, 0, MAX_MTP_LAYERS),
    ):
        _bounded(need, path, v, low, top)


def _bounded(need: Need, path: str, v: int, low: int, top: int) -> None:
    need(v >= low, path, v, "a positive integer" if low == 1 else "a non-negative integer")
    need(v <= top, path, v, f"at most {top} (the largest size this version accepts)")
