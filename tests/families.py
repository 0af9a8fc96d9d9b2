"""The tiny test models of the runtime's model families: one entry per family registered in
`ftc_runtime.models.FAMILIES` (test_registry.py holds the two lists to each other). An entry says
how transformers builds a tiny random model of the family for a seed, the checkpoint layouts ftc
reads for it, the kernel targets its engines are compiled for, and the bounds each kernel's engine
is held to against transformers' fp32 eager reference. The parity tests (test_transformers_parity.py)
run on every engine of every entry: a new family adds its entry here and gets all of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine

from fp4_checkpoints import FP4_INTERMEDIATE, LAYOUTS, save_quantized_checkpoint, widen_experts
from hf_deepseek_v4_models import build_deepseek_v4, save_deepseek_v4_checkpoint
from hf_glm_models import build_glm, save_glm_checkpoint
from hf_hybrid_models import build_hybrid, save_hybrid_checkpoint
from hf_models import TinyShape, build_model, save_checkpoint


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over every element: all positions together."""
    return float((a - b).norm() / b.norm())


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a − b‖ / ‖b‖ of each row (position) of logits [positions, vocab]."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@dataclass(frozen=True)
class Closeness:
    """How close logits of some positions come to the reference's."""
    rel: float  # relative error of all the positions together
    argmax: float = 0.0  # the least share of positions whose argmax is the reference's (0: not checked)
    # (bound, share): at least `share` of the positions each within `bound` relative; None: not checked
    per_position: tuple[float, float] | None = None

    def check(self, ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        """Asserts it; `what` (the input) goes into the failure message."""
        assert ours.shape == ref.shape, (tuple(ours.shape), tuple(ref.shape))
        err = rel(ours, ref)
        assert err < self.rel, f"{what}: relative error {err:.3g}, bound {self.rel:g}"
        # Our argmax is the reference's where the reference's logit there is within MIN_GREEDY_MARGIN of
        # its maximum: where the reference has a near tie for the best token (seen: an exact one,
        # FTC_TEST_SEED=2057458545; a gap of 4.8e-6 at 8.68 that an fp32 error of 1e-6 flipped,
        # FTC_TEST_SEED=152919780), either of the tied tokens is its argmax.
        gap = ref.amax(-1) - ref.gather(-1, ours.argmax(-1, keepdim=True))[..., 0]
        agree = float((gap < MIN_GREEDY_MARGIN).float().mean())
        assert agree >= self.argmax, f"{what}: argmax agrees at {agree:.2f} of positions, bound {self.argmax}"
        if self.per_position is not None:
            bound, share = self.per_position
            close = float((rel_rows(ours, ref) < bound).float().mean())
            assert close >= share, f"{what}: {close:.2f} of positions within {bound:g}, bound {share}"


@dataclass(frozen=True)
class Bounds:
    """What the engine of one kernel (its ISA, `engine.manifest.plan.isa`) is held to."""
    prompt: Closeness  # a prompt's logits (whole, in chunks, streamed) against transformers'
    # One-token decode steps against the engine's own logits of the whole sequence (the same kernel,
    # sums in another order): relative error of a sequence's steps
    own_steps: float
    # Each sequence's one-token steps (several batched) against transformers': relative error; None:
    # not checked (bf16, where five steps are too few for the prompt's shares of close positions)
    steps: float | None
    # None: 32 free-running greedy tokens equal transformers'; else the least share of transformers'
    # greedy tokens that the engine, teacher-forced along that path, picks too
    greedy_agreement: float | None = None


# The fp32 kernels agree with the reference to ~1e-6, so greedy decoding must agree token for token
# wherever the reference's top-2 gap exceeds this; a prompt whose greedy path has a closer tie is redrawn.
MIN_GREEDY_MARGIN = 1e-3
# Likewise the router: where a token's k-th and (k+1)-th expert scores are closer than this, the
# engine's other summation order can swap them (seen: a gap of 1.4e-5 moved one position by 7.4e-3
# in the fp32 engine); the parity tests redraw such prompts.
MIN_ROUTER_MARGIN = 1e-4
# Likewise an ill-conditioned prompt: where the fp32 reference is itself more than this share of the
# prompt bound from the same model in fp64, fp32 sums in another order land about as far again (seen: a
# Gated DeltaNet head whose decay of exp(-45) wiped its state, its output at one position 100x below
# the others, so that the gated norm scaled up the rounding: transformers 4.4e-5 from fp64 over the
# prompt, the engine 1.35e-4 from transformers against a bound of 1e-4; FTC_TEST_SEED=649002267). The
# hybrid families' chunk-wise references are 5.7e-6 from fp64 at the median, 4.2e-5 at most (90 draws).
MAX_REFERENCE_ERROR = 0.1

# The AVX2 kernel keeps activations in fp32: the engine is the reference to fp32 rounding (over 6 models
# of each checkpoint, 12 draws each: prompts in chunks at most 4e-6 from transformers, one-token steps 9e-6).
QWEN3_MOE_AVX2 = Bounds(prompt=Closeness(1e-4, argmax=1.0), own_steps=1e-4, steps=1e-4)
# The AVX-512 BF16 kernel rounds activations to bf16 (as llama.cpp's bf16 path does): logits move by
# ~0.05 at these toy scales, and a near-tie in the router can flip an expert. Most positions stay
# within bf16 rounding; one where a flip happened moves further (seen: up to 4.7e-2 overall, 87%
# argmax agreement). A free-running greedy sequence may part from the reference at such a flip: its
# check is teacher-forced instead. Prompt and one-token steps sum the dense layers in different
# orders, so a rounding boundary can fall differently between them; a cache fault moves logits far
# beyond 5e-3. (On a Xeon with AVX-512 BF16, 8 models of each checkpoint, 8 draws each: prompts at
# most 3.5e-2 off, 89% argmax agreement, 94% of positions within 1.5e-2; greedy 97%; one-token steps,
# batched or not, at most 2.2e-3 from the engine's own prompt logits.)
QWEN3_MOE_BF16 = Bounds(prompt=Closeness(8e-2, argmax=0.8, per_position=(1.5e-2, 0.8)), own_steps=5e-3, steps=None,
                        greedy_agreement=0.75)
# transformers runs the Gated DeltaNet chunk-wise, the engine token by token (the same sums in another
# order), and the engine's kernels sum the experts in their own order: ~1e-6 apart. One-token steps
# run the linear layers token by token where transformers' full forward goes chunk-wise; where the
# router's k-th and (k+1)-th experts nearly tie, that ~1e-6 difference can swap them, moving the
# output by their small weight gap: up to 2.7e-4 at one position over 1809 batched sequences, and
# 1.0e-4 for 13 steps against the engine's own prompt path (6 models of each checkpoint, 12 draws
# each). A lost state or a wrong position is off by more than 1e-2.
HYBRID_AVX2 = Bounds(prompt=Closeness(1e-4, argmax=1.0), own_steps=1e-3, steps=1e-3)
# GLM-5's latent attention runs absorbed in the engine (the latent never expanded into per-head
# keys), expanded in transformers: the same sums in another order, ~1e-6 apart in fp32.
GLM_AVX2 = Bounds(prompt=Closeness(1e-4, argmax=1.0), own_steps=1e-3, steps=1e-3)
# DeepSeek-V4's attention runs over each layer's compressed state in the engine, over the whole
# sequence in transformers; the hyper-connections' Sinkhorn steps are the same in both: ~1e-6 apart
# in fp32.
DEEPSEEK_V4_AVX2 = Bounds(prompt=Closeness(1e-4, argmax=1.0), own_steps=1e-3, steps=1e-3)


@dataclass(frozen=True)
class Checkpoint:
    """A tiny random model of the family, built by transformers, saved in one layout ftc reads."""
    id: str
    build: Callable[[int], torch.nn.Module]  # the model for a seed, eval mode, its weights bf16 values
    save: Callable[[torch.nn.Module, Path], Path]  # writes the model's checkpoint into a directory


@dataclass(frozen=True)
class TinyFamily:
    name: str  # the runtime family: a key of ftc_runtime.models.FAMILIES
    checkpoints: tuple[Checkpoint, ...]
    targets: tuple[str, ...]  # compile targets: 'cpu' is the AVX2 kernel, 'auto' this CPU's best
    bounds: dict[str, Bounds]  # by kernel ISA: one for every ISA that the targets can pick


def _qwen3_moe(id_: str, shape: TinyShape, layout: str, shards: int, dtype: torch.dtype) -> Checkpoint:
    return Checkpoint(f"{id_}-{layout}-{shards}shard-{str(dtype).removeprefix('torch.')}", partial(build_model, shape),
                      partial(save_checkpoint, layout=layout, shards=shards, dtype=dtype))


def _hybrid(family: str, layout: str, nested: bool = False) -> Checkpoint:
    return Checkpoint(layout + ("-nested" if nested else ""), partial(build_hybrid, family),
                      partial(save_hybrid_checkpoint, layout=layout, nested=nested))


def _glm(layout: str) -> Checkpoint:
    return Checkpoint(layout, build_glm, partial(save_glm_checkpoint, layout=layout))


def _deepseek_v4(layout: str, intermediate: int = 32) -> Checkpoint:
    return Checkpoint(layout, partial(build_deepseek_v4, intermediate=intermediate),
                      partial(save_deepseek_v4_checkpoint, layout=layout))


def _build_fp4_hybrid(family: str, seed: int) -> torch.nn.Module:
    return widen_experts(build_hybrid(family, seed), seed)


def _fp4(layout: str, build: Callable[[int], torch.nn.Module], nested: bool = False) -> Checkpoint:
    """The model's routed experts quantized (fp4_checkpoints) and stored in a 4-bit producer's
    layout; the reference model computes with their dequantized values. The engine's expert format
    comes from the checkpoint's settings."""
    return Checkpoint(f"{layout}{'-nested' if nested else ''}", build,
                      partial(save_quantized_checkpoint, layout=layout, nested=nested))


FP4_SHAPE = TinyShape(intermediate=FP4_INTERMEDIATE)

TINY_FAMILIES: dict[str, TinyFamily] = {f.name: f for f in [
    # Qwen3-MoE: expert layouts, shards and checkpoint dtypes, shapes beside the default (16 experts of
    # which 4 unnormalized; a dense layer, one KV head and tied embeddings), each with both kernels.
    TinyFamily("qwen3_moe", (
        _qwen3_moe("default", TinyShape(), "fused", 1, torch.bfloat16),
        _qwen3_moe("default", TinyShape(), "per_expert", 3, torch.bfloat16),
        _qwen3_moe("wide", TinyShape(hidden=96, intermediate=64, layers=3, heads=6, kv_heads=3, head_dim=32,
                                     experts=16, top_k=4, norm_topk_prob=False), "per_expert", 1, torch.float16),
        _qwen3_moe("dense1-tied", TinyShape(hidden=128, intermediate=96, layers=3, heads=4, kv_heads=1, head_dim=32,
                                            experts=12, top_k=3, mlp_only_layers=(1,), tie_embeddings=True),
                   "fused", 2, torch.float32),
        # 4-bit experts in each producer's layout, the engine's format the checkpoint's. The AVX2
        # kernel computes with exactly the dequantized fp32 weights, so its bounds hold as they are;
        # the AVX-512 BF16 kernel is held to the bf16 bounds. (On two idle cores each such engine's
        # parity tests take 1-2 s beyond a format's first kernel build, ~6 s.)
        *(_fp4(layout, partial(build_model, FP4_SHAPE)) for layout in LAYOUTS),
    ), targets=("auto", "cpu"), bounds={"avx2": QWEN3_MOE_AVX2, "avx512_bf16": QWEN3_MOE_BF16}),
    # Qwen3.5-MoE (Qwen3.6's family): split linear projections; also as the image-text model's
    # language model (`model.language_model.`, the config under `text_config`); 4-bit experts (drawn
    # anew at intermediate size 64) in an MXFP4 and an NVFP4 layout.
    TinyFamily("qwen3_5_moe", (_hybrid("qwen3_5_moe", "fused", nested=True), _hybrid("qwen3_5_moe", "per_expert"),
                               _fp4("mxfp4_gptoss", partial(_build_fp4_hybrid, "qwen3_5_moe"), nested=True),
                               _fp4("nvfp4_modelopt", partial(_build_fp4_hybrid, "qwen3_5_moe"))),
               targets=("cpu",), bounds={"avx2": HYBRID_AVX2}),
    # Qwen3-Next: grouped in_proj_qkvz / in_proj_ba.
    TinyFamily("qwen3_next", (_hybrid("qwen3_next", "fused"), _hybrid("qwen3_next", "per_expert")),
               targets=("cpu",), bounds={"avx2": HYBRID_AVX2}),
    # GLM-5.x: transformers' fused experts and GLM's own per-expert tensors, and NVFP4 experts in
    # ModelOpt's layout (GLM-5.2's NVFP4 releases).
    TinyFamily("glm_moe_dsa", (_glm("fused"), _glm("per_expert"),
                               _fp4("nvfp4_modelopt", partial(build_glm, intermediate=FP4_INTERMEDIATE))),
               targets=("cpu",), bounds={"avx2": GLM_AVX2}),
    # DeepSeek-V4: transformers' fused experts, its save_pretrained layout (the release's names under
    # "model.", per-expert w1/w3/w2), and the release itself (MXFP4 experts, FP8 projections with
    # power-of-two block scales, which the compiler dequantizes).
    TinyFamily("deepseek_v4", (_deepseek_v4("fused"), _deepseek_v4("pretrained"),
                               _deepseek_v4("released", FP4_INTERMEDIATE)),
               targets=("cpu",), bounds={"avx2": DEEPSEEK_V4_AVX2}),
]}


@dataclass(frozen=True)
class Case:
    """One engine of the parity tests: a family's checkpoint compiled for one target."""
    family: TinyFamily
    checkpoint: Checkpoint
    target: str

    @property
    def model_id(self) -> str:
        """The model's name: the same for both targets, which compile the same weights."""
        return f"{self.family.name}-{self.checkpoint.id}"

    @property
    def id(self) -> str:
        return f"{self.model_id}-{self.target}"

    def compile(self, root: Path, seed: int) -> tuple[Engine, torch.nn.Module]:
        """The model for `seed`, saved under root/ckpt (the one name keeps the kernel builds shared)
        and compiled to root/engine: the loaded engine and the reference model."""
        model = self.checkpoint.build(seed)
        ckpt = self.checkpoint.save(model, root / "ckpt")
        engine = compile_engine(CompileOptions(source=ckpt, target=self.target, output=root / "engine"))
        return Engine.load(engine), model


CASES = [Case(f, c, t) for f in TINY_FAMILIES.values() for t in f.targets for c in f.checkpoints]


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def fp64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the reference model that computes in fp64 (its experts one by one: transformers'
    grouped matmul has no fp64 kernel)."""
    model64 = copy.deepcopy(model).double()
    model64.config._experts_implementation = "eager"
    return model64


def well_conditioned(model: torch.nn.Module, model64: torch.nn.Module, ids: list[int], bound: float) -> bool:
    """Whether an engine can be held to the relative `bound` on `ids`: the reference (`model`, and
    `model64` its fp64 copy) has no router near tie there, and fp32 rounding moves its logits by less
    than MAX_REFERENCE_ERROR of the bound."""
    if router_margin(model, ids) < MIN_ROUTER_MARGIN:
        return False
    return rel(reference_logits(model, ids), reference_logits(model64, ids)) < MAX_REFERENCE_ERROR * bound


@torch.no_grad()
def router_margin(model: torch.nn.Module, ids: list[int]) -> float:
    """The reference's smallest gap, over the prompt's tokens and MoE layers, between a token's k-th
    and (k+1)-th expert by the score its router chooses on (a biased router: its score, sigmoid or
    DeepSeek-V4's `score_fn`, plus its selection bias); a router by token id has none."""
    k, gaps = model.config.num_experts_per_tok, []

    def record(module: torch.nn.Module, _inputs: tuple, out: torch.Tensor | tuple) -> None:
        if hasattr(module, "tid2eid"):
            return
        logits = (out[0] if isinstance(out, tuple) else out).float()
        bias = getattr(module, "e_score_correction_bias", None)
        scores = logits if bias is None else getattr(module, "score_fn", torch.sigmoid)(logits) + bias.float()
        top = scores.topk(k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    forward_with_hooks(model, ids, [m for name, m in model.named_modules() if name.endswith("mlp.gate")], record)
    return min(gaps, default=float("inf"))


def forward_with_hooks(model: torch.nn.Module, ids: list[int], modules: list[torch.nn.Module], record) -> None:
    """The reference's forward over `ids` with `record` hooked to the outputs of `modules`."""
    hooks = [m.register_forward_hook(record) for m in modules]
    try:
        model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens, and the smallest gap between the best and second-best logit on the way."""
    seq, margin = list(ids), float("inf")
    for _ in range(steps):
        logits = model(torch.tensor([seq])).logits[0, -1]
        top2 = logits.topk(2).values
        margin = min(margin, float(top2[0] - top2[1]))
        seq.append(int(logits.argmax()))
    return seq[len(ids):], margin
