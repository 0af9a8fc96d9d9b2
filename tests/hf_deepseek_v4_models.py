"""Tiny random DeepSeek-V4 models (every attention kind: sliding, CSA with its indexer, HCA; hash
layers with a random `tid2eid`; hyper-connections of 4 streams; YaRN on the compressed rope; a
SwiGLU limit that clamps) built with transformers, saved as checkpoints in the layouts ftc reads:
transformers' own names ('fused'), what `save_pretrained` writes ('pretrained'), and DeepSeek's
release ('released': no "model." prefix, the routed experts MXFP4, the attention's and the shared
expert's linears block-scaled FP8).

Saving 'released' overwrites the quantized parameters with their dequantized values, so the model
is the checkpoint's exact reference, as fp4_checkpoints does.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

from ftc_runtime.models.deepseek_v4.loader import canonical_name

from fp4_checkpoints import _bytes, _e8m0, _expert_tensors, _quantize_experts
from fp4_reference import E4M3_MAX, E8M0_BIAS, e4m3_to_float, float_to_e4m3
from hf_tokenizer import save_tokenizer

VOCAB = 320
LAYOUTS = ("fused", "pretrained", "released")
# The parity tests' prompts are at most 100 tokens: CSA's indexer then keeps every causal entry (at
# most 100 / 4), as exact parity needs (ReLU scores of exactly 0 tie, and top-k breaks ties
# arbitrarily); the sparse choice is tested elsewhere (test_deepseek_v4_attention.py, `tiny`).
INDEX_TOP_K = 64
SLIDING_WINDOW = 8
# 8 indexer heads: an entry's score is exactly 0 (tied with others, so top-k picks arbitrarily) only
# where all 8 heads' ReLUs are 0, which the parity tests' top-k of 2 meets far less often than with 4.
INDEX_HEADS = 8
# Small enough that some of the experts' gate and up pre-activations are clamped (about 8% of them).
SWIGLU_LIMIT = 2.0
YARN_FACTOR, YARN_ORIGINAL_CONTEXT = 4, 128  # the compressed rope's: YaRN moves 3 of its 4 frequencies
ROUTER_SCALE = 8.0  # decisive routing: widely spread scores, so that top-k choices are seldom near ties
HEAD_SCALE = 4.0  # decisive greedy tokens
# The tensors DeepSeek's release keeps in fp32 (transformers' names); every other float is bf16.
FP32_TENSORS = re.compile(r"(^|\.)(hc_head|attn_hc|ffn_hc)\.|\.(sinks|position_bias|e_score_correction_bias)$")
# The linears the release stores as block-scaled FP8: the attention's own (not its compressors' or
# indexer's) and the shared expert's.
FP8_LINEARS = re.compile(r"\.self_attn\.(q_a|q_b|kv|o_a|o_b)_proj\.weight$"
                         r"|\.shared_experts\.(gate|up|down)_proj\.weight$")
FP8_BLOCK = 128
RELEASED_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                         "activation_scheme": "dynamic"}
# transformers' names → the release's: the inverse of transformers' deepseek_v4 conversion mapping
# (ftc's RELEASED_RENAMES), applied in order. The attention's `kv_norm` keeps its name; its
# compressors' is `norm`.
TO_RELEASED = tuple((re.compile(a), b) for a, b in (
    (r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^hc_head\.hc_", "hc_head_"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.", r".hc_\1_"), (r"\.sinks$", ".attn_sink"), (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."), (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."), (r"\.gate\.e_score_correction_bias$", ".gate.bias")))


def deepseek_v4_fields(intermediate: int = 32, index_top_k: int = INDEX_TOP_K,
                       sliding_window: int = SLIDING_WINDOW) -> dict:
    """config.json's fields: four layers (sliding, CSA, HCA, CSA; the first two hash-routed), 8
    experts of `intermediate` (the shared one too), 2 a token; CSA compresses 4 tokens an entry,
    HCA 8, so that short prompts close several windows."""
    return {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": intermediate, "num_hidden_layers": 4,
            "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 24, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "o_groups": 2, "o_lora_rank": 16,
            "index_n_heads": INDEX_HEADS, "index_head_dim": 16, "index_topk": index_top_k,
            "sliding_window": sliding_window, "hc_mult": 4, "num_nextn_predict_layers": 0,  # DsV4MtpHead adds one
            "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], "swiglu_limit": SWIGLU_LIMIT,
            # YaRN's stretch of the original context is the whole context: transformers warns otherwise.
            "max_position_embeddings": YARN_ORIGINAL_CONTEXT * YARN_FACTOR,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": float(YARN_FACTOR),
                                             "original_max_position_embeddings": YARN_ORIGINAL_CONTEXT,
                                             "attention_factor": 1.0, "partial_rotary_factor": 0.25}}}


def _draw(name: str, shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """A parameter's random value: matrices N(0, 1 / fan-in), so activations stay O(1) (the router
    and the head scaled up); norms in [1, 1.5]; biases, sinks and the streams' scales N(0, 0.25)."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.5 * torch.rand(shape, generator=g)
    noise = torch.randn(shape, generator=g)
    if len(shape) < 2 or name.endswith("position_bias"):
        return 0.5 * noise
    scale = ROUTER_SCALE if name.endswith("mlp.gate.weight") else HEAD_SCALE if name == "lm_head.weight" else 1.0
    return noise * scale * shape[-1] ** -0.5


def random_model(fields: dict, g: torch.Generator) -> DeepseekV4ForCausalLM:
    """transformers' model of `fields` in fp32, eager attention, every tensor drawn from `g`: each
    value bf16's but in the tensors the release keeps in fp32 (the bf16 checkpoint's reference runs
    its values in fp32); each hash layer's `tid2eid` (transformers' zeros) distinct experts a token."""
    cfg = DeepseekV4Config(**fields)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    _draw_all(model, cfg, g)
    return model


def _draw_all(module: torch.nn.Module, cfg: DeepseekV4Config, g: torch.Generator) -> None:
    """Every parameter and buffer of `module` drawn as `random_model` says."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            value = _draw(name, p.shape, g)
            p.copy_(value if FP32_TENSORS.search(name) else value.to(torch.bfloat16).float())
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))  # the bias steers the choice too
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))


def build_deepseek_v4(seed: int, intermediate: int = 32) -> DeepseekV4ForCausalLM:
    """The tiny model of `deepseek_v4_fields` (experts of `intermediate`: ftc's 4-bit formats need a
    multiple of 64) drawn from `seed`."""
    return random_model(deepseek_v4_fields(intermediate), torch.Generator().manual_seed(seed))


def tiny(rng: random.Random, g: torch.Generator) -> tuple[DeepseekV4ForCausalLM, dict]:
    """test_deepseek_v4_model's model: its indexer keeps 2 entries or all of them and its window is
    3 or 8 tokens (from `rng`), its weights from `g`; with its config fields."""
    fields = deepseek_v4_fields(index_top_k=rng.choice([2, INDEX_TOP_K]), sliding_window=rng.choice([3, 8]))
    return random_model(fields, g), fields


def released_name(name: str) -> str:
    """A tensor's name in DeepSeek's release, from transformers' name; checked against ftc's
    `canonical_name`, so that the two never drift apart."""
    released = name
    for pattern, target in TO_RELEASED:
        released = pattern.sub(target, released)
    assert canonical_name(released) == name, f"{name} → {released} → {canonical_name(released)}"
    return released


def _storage_dtype(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor (by transformers' name) as the checkpoints store it: the release's fp32 set in
    fp32, integers (`tid2eid`) as they are, the rest bf16."""
    if not t.dtype.is_floating_point:
        return t.contiguous()
    return t.detach().to(torch.float32 if FP32_TENSORS.search(name) else torch.bfloat16).contiguous()


def _fp8_exponents(w: np.ndarray) -> np.ndarray:
    """Each 128 × 128 block's scale exponent e [ceil(N/128), ceil(K/128)]: the smallest with
    amax / 2^e ≤ 448 (e8m0's least, -127, for an all-zero block)."""
    n, k = w.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = np.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), np.float64)
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK).max(axis=(1, 3))
    # log2 rounds: step the estimate to the exact bound, which float64 holds (amax is a float32).
    e = np.ceil(np.log2(np.maximum(amax, 2.0 ** -200) / E4M3_MAX))
    e += amax > np.ldexp(E4M3_MAX, e.astype(np.int64))
    e -= amax <= np.ldexp(E4M3_MAX, e.astype(np.int64) - 1)
    return np.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(np.int64)


def _quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-scaled FP8 of a float32 matrix [N, K]: e4m3 codes [N, K], e8m0 scale bytes (one per
    128 × 128 block) and the dequantized matrix, codes · 2^e (exact: both scalings are by powers of two)."""
    e = _fp8_exponents(w)
    per_value = np.repeat(np.repeat(e, FP8_BLOCK, 0), FP8_BLOCK, 1)[: w.shape[0], : w.shape[1]]
    codes = float_to_e4m3(np.ldexp(w, -per_value).astype(np.float32))
    return codes, (e + E8M0_BIAS).astype(np.uint8), np.ldexp(e4m3_to_float(codes), per_value).astype(np.float32)


def _fp8_tensors(released: str, weight: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """A linear's FP8 weight and its scales as the release names them (`X.weight`, `X.scale`); the
    parameter is overwritten with the dequantized values."""
    codes, scales, dequantized = _quantize_fp8(weight.detach().numpy())
    with torch.no_grad():
        weight.copy_(torch.from_numpy(dequantized))
    return {released: _bytes(codes, torch.float8_e4m3fn), released.removesuffix("weight") + "scale": _e8m0(scales)}


def _released_tensors(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's tensors as DeepSeek released them: the routed experts MXFP4 per expert
    (`ffn.experts.J.w1|w3|w2.weight` int8, `.scale` e8m0), FP8_LINEARS block-scaled FP8, the rest
    as `_storage_dtype` says. The quantized parameters are overwritten with their dequantized values.
    `prefix`: what the module's names lack of transformers' (a decoder layer's "model.layers.L.")."""
    params = {prefix + k: v for k, v in model.named_parameters()}
    tensors = {}
    for name, value in ((prefix + k, v) for k, v in model.state_dict().items()):
        released = released_name(name)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            experts = _quantize_experts(params[name], params[base + "down_proj"], "mxfp4_dsv4")
            tensors |= _expert_tensors(released.removesuffix("gate_up_proj"), experts, "mxfp4_dsv4")
        elif FP8_LINEARS.search(name):
            tensors |= _fp8_tensors(released, params[name])
        elif not name.endswith("mlp.experts.down_proj"):  # quantized with gate_up_proj
            tensors[released] = _storage_dtype(name, value)
    return tensors


class DsV4MtpHead(torch.nn.Module):
    """DeepSeek-V4's multi-token-prediction layer as released (`mtp.0.*`) and as vLLM's
    deepseek_v4_mtp runs it, the reference the engine's is held to: the model's streams before its
    head's collapse, each RMS-normed (hnorm) and projected (h_proj), plus the next token's
    embedding (zeros at position 0), normed (enorm) and projected (e_proj) into every stream; one
    decoder layer with a sliding-window attention and a learned router (transformers'); its own
    stream collapse (hc_head), norm and the model's LM head. Drawn as `random_model` draws."""

    def __init__(self, model: DeepseekV4ForCausalLM, seed: int):
        super().__init__()
        cfg = DeepseekV4Config(**(model.config.to_dict() | {
            "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}))
        cfg._attn_implementation = "eager"
        h = cfg.hidden_size
        self.layer = DeepseekV4DecoderLayer(cfg, 0)
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(h, cfg.rms_norm_eps) for _ in range(3))
        self.e_proj, self.h_proj = torch.nn.Linear(h, h, bias=False), torch.nn.Linear(h, h, bias=False)
        self.hc_head = DeepseekV4HyperHead(cfg)
        _draw_all(self, cfg, torch.Generator().manual_seed(seed))
        self.float().eval()

    def released_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors as the release names and stores them (`mtp.0.*`: the decoder layer's as a
        layer's are, e_proj and h_proj FP8); the quantized parameters become their dequantized values."""
        tensors = {"mtp.0." + k.removeprefix("layers.0."): v
                   for k, v in _released_tensors(self.layer, "model.layers.0.").items()}
        for name in ("e_proj", "h_proj"):
            tensors |= _fp8_tensors(f"mtp.0.{name}.weight", getattr(self, name).weight)
        tensors |= {f"mtp.0.{n}.weight": getattr(self, n).weight.detach().to(torch.bfloat16).contiguous()
                    for n in ("enorm", "hnorm", "norm")}
        return tensors | {f"mtp.0.hc_head_{n}": getattr(self.hc_head, f"hc_{n}").detach().contiguous()
                          for n in ("fn", "base", "scale")}

    def forward(self, model: DeepseekV4ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor,
                layer_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] of rows at positions 0 .. T - 1 (hidden [T, streams · H]: the model's
        streams there before its head's collapse, next_ids [T]: the token after each), and the
        streams a further draft takes as its hidden state."""
        e = model.model.embed_tokens(next_ids)
        e[0] = 0  # position 0
        streams = hidden.view(hidden.shape[0], model.config.hc_mult, -1)
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(e))[:, None]
        x = self.layer(x[None], **layer_kwargs)[0]
        return model.lm_head(self.norm(self.hc_head(x[None])[0])).float(), x.flatten(1)

    @staticmethod
    def layer_inputs(model: DeepseekV4ForCausalLM, ids: list[int]) -> tuple[torch.Tensor, dict]:
        """The model's streams before its head's collapse [T, streams · H] over `ids`, and the
        keyword arguments (mask, positions, position embeddings) its sliding-window layer 0 took."""
        taken, streams = {}, []

        def take(_module, _args, kwargs):
            taken.update({k: kwargs[k] for k in ("attention_mask", "position_ids", "position_embeddings")})

        hooks = [model.model.layers[0].register_forward_pre_hook(take, with_kwargs=True),
                 model.model.hc_head.register_forward_pre_hook(lambda _m, args: streams.append(args[0]))]
        try:
            model.model(torch.tensor([ids]), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        return streams[0][0].flatten(1), taken


def _save_pretrained(model: DeepseekV4ForCausalLM, directory: Path) -> None:
    """`save_pretrained`'s files, their tensors in the checkpoints' dtypes (it writes the fp32
    model's in fp32), each tensor's told by its transformers name (the stored ones are the release's)."""
    model.save_pretrained(directory)
    for path in directory.glob("*.safetensors"):
        tensors = {k: _storage_dtype(canonical_name(k), v) for k, v in load_file(path).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})


def save_deepseek_v4_checkpoint(model: DeepseekV4ForCausalLM, directory: Path, layout: str,
                                mtp: DsV4MtpHead | None = None) -> Path:
    """Writes the model in `layout` (one of LAYOUTS) with config.json and tokenizer.json; returns
    `directory`. 'released' needs experts of a multiple of 64 (`build_deepseek_v4(seed, 64)`), and
    its config.json says the release's quantization; `mtp` ('released' only): its `mtp.0.*` tensors
    too, and `num_nextn_predict_layers` 1 (the model's config says 0)."""
    if mtp is not None and layout != "released":
        raise ValueError(f"an MTP layer is saved as released, not in layout {layout!r}")
    if layout not in LAYOUTS:
        raise ValueError(layout)
    if layout == "released" and model.config.moe_intermediate_size % 64:
        raise ValueError(f"MXFP4 experts need an intermediate size that is a multiple of 64, not "
                         f"{model.config.moe_intermediate_size}")
    directory.mkdir(parents=True, exist_ok=True)
    if layout == "pretrained":
        _save_pretrained(model, directory)
    else:
        tensors = (_released_tensors(model) if layout == "released"
                   else {k: _storage_dtype(k, v) for k, v in model.state_dict().items()})
        tensors |= mtp.released_tensors() if mtp is not None else {}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict() | ({"num_nextn_predict_layers": 1} if mtp is not None else {})
    if layout == "released":
        config |= {"quantization_config": dict(RELEASED_QUANTIZATION), "expert_dtype": "fp4"}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_tokenizer(directory)
    return directory
