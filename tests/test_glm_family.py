"""GLM-5.x beyond the shared parity tests (tests/families.py): prompts longer than a query block of
latent attention against transformers; prompts longer than the indexer's top_k, each query on a
sparse choice of keys, the same whole, in chunks and in steps; the tiny spec
(model_specs/glm-5-tiny.yaml) compiled from random weights in bf16 and NVFP4."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file, save_file
from transformers import GlmMoeDsaConfig

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.models.glm_moe_dsa.loader import kv_row_elements
from ftc_runtime.models.glm_moe_dsa.model import QUERY_BLOCK
from ftc_runtime.spec import SpecError

from families import MIN_ROUTER_MARGIN, reference_logits, rel, router_margin
from hf_glm_models import VOCAB, build_glm, save_glm_checkpoint

TINY_SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "glm-5-tiny.yaml"


def test_a_long_prompt_matches_transformers(tmp_path, seed):
    """A prompt of more than QUERY_BLOCK tokens (the indexer's top_k above its length: dense, as
    exact parity needs; none with a router near tie, which fp32 sums in another order may flip),
    whole and in uneven chunks, then one-token steps."""
    rng = random.Random(seed)
    model, ids = _model_and_prompt_without_router_tie(rng, QUERY_BLOCK + rng.randrange(20, 60))
    engine_dir = compile_engine(CompileOptions(source=save_glm_checkpoint(model, tmp_path / "ckpt", "fused"),
                                               target="cpu", output=tmp_path / "engine"))
    want = reference_logits(model, ids)
    assert rel(Engine.load(engine_dir).logits(ids), want) < 1e-4
    chunked = Engine.load(engine_dir, prefill_chunk=rng.randrange(40, 120))
    assert rel(chunked.logits(ids), want) < 1e-4
    assert rel(_last_as_steps(chunked, ids, 4), want[-4:]) < 1e-4


def _model_and_prompt_without_router_tie(rng: random.Random, length: int) -> tuple[torch.nn.Module, list[int]]:
    """A model (index_top_k above `length`) and a prompt of `length` with no router near tie. Over a
    thousand tokens and three MoE layers, one in five prompts has none on a typical model and some
    models have almost none (30 models, 10 prompts each: 0 to 8 of 10): both are redrawn."""
    for _ in range(20):
        model = build_glm(rng.randrange(2**31), index_top_k=1024)
        for _ in range(10):
            ids = [rng.randrange(VOCAB) for _ in range(length)]
            if router_margin(model, ids) >= MIN_ROUTER_MARGIN:
                return model, ids
    pytest.fail(f"20 models, 10 prompts each: every prompt had a router near tie (< {MIN_ROUTER_MARGIN})")


def test_a_sparse_prompt_gives_the_same_logits_in_chunks_and_steps(tmp_path, seed):
    """Each query past its 48th token attends to 48 keys, the indexer's choice, ties broken the same
    way whatever the chunks (select_keys): the prompt whole, in uneven chunks and its last tokens as
    one-token steps agree (the AVX2 kernels are fp32: the same sums in other orders)."""
    rng = random.Random(seed)
    model = build_glm(seed, index_top_k=48)
    engine_dir = compile_engine(CompileOptions(source=save_glm_checkpoint(model, tmp_path / "ckpt", "fused"),
                                               target="cpu", output=tmp_path / "engine"))
    ids = [rng.randrange(VOCAB) for _ in range(QUERY_BLOCK + rng.randrange(20, 60))]
    whole = Engine.load(engine_dir).logits(ids)
    chunk = rng.randrange(30, 120)
    assert rel(Engine.load(engine_dir, prefill_chunk=chunk).logits(ids), whole) < 1e-4, f"chunks of {chunk}"
    assert rel(_last_as_steps(Engine.load(engine_dir), ids, 6), whole[-6:]) < 1e-4


def _last_as_steps(engine: Engine, ids: list[int], n: int) -> torch.Tensor:
    """The logits of the last n tokens, each as a one-token step after the ones before."""
    cache = engine.model.new_cache()
    engine.model.forward(torch.tensor(ids[:-n]), cache)
    return torch.cat([engine.model.forward(torch.tensor([t]), cache) for t in ids[-n:]])


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_the_tiny_spec_compiles_and_decodes(tmp_path, quant, seed):
    """glm-5-tiny from random weights (its indexer's top_k of 32 below the prompt's length): the
    prompt's logits whole, in chunks and as one-token steps agree (the AVX2 kernels are fp32: the
    same sums in other orders) and are finite."""
    rng = random.Random(seed)
    engine_dir = compile_engine(CompileOptions(source=TINY_SPEC, random_weights=True, seed=seed % 1000, quant=quant,
                                               target="cpu", output=tmp_path / "engine"))
    engine = Engine.load(engine_dir)
    assert engine.spec.family == "glm_moe_dsa" and engine.spec.indexer.top_k < 60
    ids = [rng.randrange(500) for _ in range(rng.randrange(60, 90))]
    whole = engine.logits(ids)
    assert rel(Engine.load(engine_dir, prefill_chunk=rng.randrange(7, 30)).logits(ids), whole) < 1e-4
    assert rel(_last_as_steps(engine, ids, len(ids) - 40), whole[40:]) < 1e-4
    assert torch.isfinite(whole).all()


# Each case: (the edit of the tiny spec, as (section, field, value)), the field path the refusal must
# name and the bad value it must show (None: no value to show).
GLM_INVALID = {
    "mla_on_gqa": (("attention", "kind", "gqa"), "mla", None),
    "head_dim_not_nope_plus_rope": (("attention", "head_dim", 32), "attention.head_dim", 32),
    "layer_types_too_short": (("indexer", "layer_types", ["full"] * 3), "indexer.layer_types", 3),
    "unknown_layer_type": (("indexer", "layer_types", ["full", "sparse", "full", "shared"]),
                           "indexer.layer_types[1]", "sparse"),
    "first_layer_shared": (("indexer", "layer_types", ["shared", "full", "full", "shared"]),
                           "indexer.layer_types[0]", "shared"),
    "groups_not_dividing": (("moe", "n_group", 3), "moe.n_group", 3),
    "too_few_groups_for_top_k": (("moe", "top_k", 9), "moe.topk_group", 2),
    "softmax_router": (("moe", "router", "softmax_topk"), "moe.router", "softmax_topk"),
}


@pytest.mark.parametrize("case", sorted(GLM_INVALID))
def test_an_invalid_glm_spec_is_refused_naming_field_and_value(case, tmp_path):
    data = yaml.safe_load(TINY_SPEC.read_text())
    (section, key, bad), field, value = GLM_INVALID[case]
    data[section][key] = bad
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert f"'{field}'" in msg and str(path) in msg, msg
    if value is not None:
        assert f"= {value!r}" in msg, msg


def test_glm_5_2_config_maps_onto_its_spec(tmp_path):
    """GLM-5.2's config.json (its real shapes; IndexShare: the indexer every 4th layer from layer 3
    on, and in layers 0-2) as transformers writes it: the spec has its shapes, the indexer's
    layers are transformers' own `indexer_types`, and the KV row is the latent, its rotary key and
    the indexer's key."""
    cfg = GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 1e6})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    spec, _ = load_spec(tmp_path)
    assert (spec.family, spec.num_layers, spec.hidden_size, spec.vocab_size) == ("glm_moe_dsa", 78, 6144, 154880)
    assert spec.indexer.layer_types == tuple(cfg.indexer_types)
    assert [i for i, t in enumerate(spec.indexer.layer_types) if t == "full"][:5] == [0, 1, 2, 6, 10]
    assert (spec.mla.kv_lora_rank, spec.mla.rope_dim, spec.mla.nope_dim, spec.mla.v_dim) == (512, 64, 192, 256)
    assert spec.moe_layers[0] == 3 and spec.moe.dense_intermediate_size == 12288
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.routed_scaling_factor) == (256, 8, 2.5)
    assert spec.moe.shared_expert_intermediate_size == 2048 and spec.indexer.top_k == 2048
    assert kv_row_elements(spec) == 512 + 64 + 128


@pytest.mark.parametrize("name", ["glm-5.2", "glm-5"])
def test_a_real_spec_without_its_checkpoint_says_which_and_how_to_pass_it(tmp_path, name):
    """The shipped real-shape specs name their checkpoint; where it is not there, compiling stops
    before any work, naming the folder, where it was named, and --checkpoint."""
    data = yaml.safe_load((TINY_SPEC.parent / f"{name}.yaml").read_text())
    spec, checkpoint = load_spec(TINY_SPEC.parent / f"{name}.yaml")
    assert spec.num_layers == 78 and spec.indexer.layer_types[:3] == ("full",) * 3 and checkpoint is not None
    missing = tmp_path / "not-downloaded"
    assert load_spec(TINY_SPEC.parent / f"{name}.yaml", [f"checkpoint={missing}"])[1] == missing  # --override
    data["checkpoint"] = str(missing)
    spec_path = tmp_path / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as info:
        compile_engine(CompileOptions(source=spec_path, target="cpu", output=tmp_path / "engine"))
    msg = str(info.value)
    assert str(missing) in msg and str(spec_path) in msg and "--checkpoint DIR" in msg, msg
    assert not (tmp_path / "engine").exists()


def test_the_headline_target_builds_avx512_kernels_checked_where_the_cpu_has_them(tmp_path):
    """`ftc compile ... --target rtx-pro-6000` (the tiny spec, random weights): AVX-512 BF16 CPU
    kernels for the paper's Xeon 8559C; on a CPU without AVX-512 BF16 their check is named as not
    run (it runs when the engine loads on the target), on one with it the check passes."""
    from ftc_runtime.cpu_info import missing_flags

    console = Console(file=io.StringIO(), width=200)
    engine = compile_engine(CompileOptions(source=TINY_SPEC, target="rtx-pro-6000", random_weights=True,
                                           output=tmp_path / "engine"), console=console)
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["plan"]["isa"] == "avx512_bf16" and manifest["target"]["gpu"] == "RTX PRO 6000"
    if missing_flags("avx512_bf16"):
        assert manifest["kernel_check"][0]["not_run"].startswith("compiling machine lacks")
        assert "kernel check not run" in console.file.getvalue()
    else:
        assert all("not_run" not in c for c in manifest["kernel_check"])


def test_the_multi_token_prediction_layer_is_named_and_not_read(tmp_path, seed):
    """A checkpoint with a layer past the config's (GLM's multi-token prediction, model.layers.N):
    compiling names it in one line and builds the engine of the N layers, which still matches
    transformers' model without it."""
    model = build_glm(seed)
    ckpt = save_glm_checkpoint(model, tmp_path / "ckpt", "fused")
    state = load_file(ckpt / "model.safetensors")
    n = model.config.num_hidden_layers
    extra = {k.replace("model.layers.1.", f"model.layers.{n}.", 1): v.clone() for k, v in state.items()
             if k.startswith("model.layers.1.")}
    save_file(state | extra, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    out = io.StringIO()
    engine_dir = compile_engine(CompileOptions(source=ckpt, target="cpu", output=tmp_path / "engine"),
                                Console(file=out, width=200))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("not read:")]
    assert lines == [f"not read: model.layers.{n} ({len(extra)} tensors), past the spec's {n} layers "
                     "(multi-token prediction)"], out.getvalue()
    ids = [random.Random(seed).randrange(VOCAB) for _ in range(12)]
    assert rel(Engine.load(engine_dir).logits(ids), reference_logits(model, ids)) < 1e-4
