"""Model specs: the shipped YAML files load, every kind of bad field is refused with a SpecError that
names the field and the value, `--override` edits apply, and HF `config.json` files map onto specs."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
import yaml
from transformers import Qwen3MoeConfig

from ftc.compile.spec_loader import load_spec
from ftc_runtime import spec as spec_mod
from ftc_runtime.spec import ModelSpec, SpecError

from field_edits import DELETE, set_field
from hf_models import TinyShape, build_model, save_checkpoint
from hf_tokenizer import TOKENIZER_TOKENS

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
TINY = SPECS / "qwen3-moe-tiny.yaml"
BIG = SPECS / "qwen3-30b-a3b.yaml"


def _tiny_dict() -> dict:
    return yaml.safe_load(TINY.read_text())


def _write(tmp_path: Path, data, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- the shipped specs --------------------------------------------------------------------------------


def test_qwen3_30b_a3b_spec_loads_with_its_real_shapes():
    spec, checkpoint = load_spec(BIG)
    assert checkpoint is None
    assert (spec.name, spec.family) == ("qwen3-30b-a3b", "qwen3_moe")
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (48, 2048, 151936)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_intermediate_size) == (128, 8, 768)
    assert (spec.attention.num_heads, spec.attention.num_kv_heads, spec.attention.head_dim) == (32, 4, 128)
    assert spec.expert_bytes == 3 * 2048 * 768 * 2
    assert spec.moe_layers == tuple(range(48))
    assert spec.eos_token_ids == (151645, 151643)
    assert spec.token_id("</think>") == 151668


def test_tiny_spec_loads_and_round_trips_through_a_dict():
    spec, _ = load_spec(TINY)
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (4, 256, 512)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_intermediate_size) == (16, 4, 128)
    assert spec.expert_bytes == 3 * 256 * 128 * 2
    assert spec.tokens.boundaries == ("</think>", "</tool_call>", "</tool_response>", "<|im_end|>")
    assert ModelSpec.from_dict(spec.to_dict()) == spec


# -- invalid specs --------------------------------------------------------------------------------------
# Each case edits the tiny spec and returns (the field path the message must name, the bad value it
# must show, or None where there is no value to show).


def _missing_top(d, rng):
    set_field(d, "hidden_size", DELETE)
    return "hidden_size", None


def _missing_nested(d, rng):
    set_field(d, "moe.top_k", DELETE)
    return "moe.top_k", None


def _unknown_top(d, rng):
    d["hiden_size"] = rng.randint(1, 999)
    return "hiden_size", None


def _unknown_nested(d, rng):
    d["attention"]["num_kv_head"] = rng.randint(1, 9)
    return "attention.num_kv_head", None


def _string_for_int(d, rng):
    set_field(d, "num_layers", str(rng.randint(1, 9)))
    return "num_layers", d["num_layers"]


def _float_for_int(d, rng):
    set_field(d, "moe.num_experts", rng.randint(2, 30) + 0.5)
    return "moe.num_experts", d["moe"]["num_experts"]


def _bool_for_int(d, rng):
    set_field(d, "vocab_size", True)
    return "vocab_size", True


def _int_for_bool(d, rng):
    set_field(d, "attention.qk_norm", rng.choice([0, 1]))
    return "attention.qk_norm", d["attention"]["qk_norm"]


def _list_for_mapping(d, rng):
    set_field(d, "moe", [rng.randint(1, 9), rng.randint(1, 9)])
    return "moe", d["moe"]


def _string_in_int_list(d, rng):
    set_field(d, "moe.dense_layers", ["first"])
    set_field(d, "moe.dense_intermediate_size", 64)
    return "moe.dense_layers[0]", "first"


def _top_k_over_experts(d, rng):
    set_field(d, "moe.top_k", rng.randint(17, 200))
    return "moe.top_k", d["moe"]["top_k"]


def _kv_heads_not_dividing(d, rng):
    set_field(d, "attention.num_heads", 12)
    set_field(d, "attention.num_kv_heads", rng.choice([5, 7, 8, 9, 10, 11]))
    return "attention.num_kv_heads", d["attention"]["num_kv_heads"]


def _unknown_family(d, rng):
    set_field(d, "family", rng.choice(["llama", "mixtral", "qwen2_moe"]))
    return "family", d["family"]


def _unknown_router(d, rng):
    set_field(d, "moe.router", rng.choice(["sigmoid_topk", "expert_choice"]))
    return "moe.router", d["moe"]["router"]


def _negative_hidden(d, rng):
    set_field(d, "hidden_size", -rng.randint(1, 4096))
    return "hidden_size", d["hidden_size"]


def _zero_experts(d, rng):
    set_field(d, "moe.num_experts", 0)
    return "moe.num_experts", 0


def _zero_head_dim(d, rng):
    set_field(d, "attention.head_dim", 0)
    return "attention.head_dim", 0


def _odd_head_dim(d, rng):
    set_field(d, "attention.head_dim", 2 * rng.randint(1, 64) + 1)
    return "attention.head_dim", d["attention"]["head_dim"]


def _eos_not_special(d, rng):
    name = f"<|eos_{rng.randint(0, 999)}|>"
    set_field(d, "tokens.eos", ["<|im_end|>", name])
    return "tokens.eos[1]", name


def _bos_not_special(d, rng):
    set_field(d, "tokens.bos", "<s>")
    return "tokens.bos", "<s>"


def _special_id_too_large(d, rng):
    set_field(d, "tokens.special.<think>", rng.randint(512, 10**6))
    return "tokens.special.<think>", d["tokens"]["special"]["<think>"]


def _special_id_negative(d, rng):
    set_field(d, "tokens.special.<think>", -1)
    return "tokens.special.<think>", -1


def _dense_layer_out_of_range(d, rng):
    bad = rng.randint(4, 50)
    set_field(d, "moe.dense_layers", [0, bad])
    set_field(d, "moe.dense_intermediate_size", 64)
    return "moe.dense_layers[1]", bad


def _dense_layers_without_size(d, rng):
    set_field(d, "moe.dense_layers", [rng.randint(0, 3)])
    return "moe.dense_intermediate_size", 0


def _every_layer_dense(d, rng):
    set_field(d, "moe.dense_layers", [0, 1, 2, 3])
    set_field(d, "moe.dense_intermediate_size", 64)
    return "moe.dense_layers", [0, 1, 2, 3]


def _bad_norm_kind(d, rng):
    set_field(d, "norm.kind", "layernorm")
    return "norm.kind", "layernorm"


def _rotary_factor_over_one(d, rng):
    set_field(d, "rope.partial_rotary_factor", 1.0 + rng.randint(1, 9) / 10)
    return "rope.partial_rotary_factor", d["rope"]["partial_rotary_factor"]


def _layer_kinds_wrong_length(d, rng):
    set_field(d, "layer_kinds", ["full_attention"] * 3)
    return "layer_kinds", 3


def _shared_experts(d, rng):
    set_field(d, "moe.num_shared_experts", rng.randint(1, 4))
    return "moe.num_shared_experts", d["moe"]["num_shared_experts"]


INVALID = [_missing_top, _missing_nested, _unknown_top, _unknown_nested, _string_for_int, _float_for_int,
           _bool_for_int, _int_for_bool, _list_for_mapping, _string_in_int_list, _top_k_over_experts,
           _kv_heads_not_dividing, _unknown_family, _unknown_router, _negative_hidden, _zero_experts,
           _zero_head_dim, _odd_head_dim, _eos_not_special, _bos_not_special, _special_id_too_large,
           _special_id_negative, _dense_layer_out_of_range, _dense_layers_without_size, _every_layer_dense,
           _bad_norm_kind, _rotary_factor_over_one, _layer_kinds_wrong_length, _shared_experts]


@pytest.mark.parametrize("case", INVALID, ids=lambda f: f.__name__.strip("_"))
def test_invalid_spec_is_refused_naming_field_and_value(case, tmp_path, seed):
    data = _tiny_dict()
    field, value = case(data, random.Random(seed))
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert f"'{field}'" in msg, msg
    assert str(path) in msg, msg
    if value is not None:
        assert f"= {value!r}" in msg, msg


def test_the_unedited_tiny_dict_is_valid(tmp_path):
    """The invalid cases above fail because of their edit, not because of how the file is written."""
    spec, _ = load_spec(_write(tmp_path, _tiny_dict()))
    assert spec == load_spec(TINY)[0]


def test_top_level_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- name: qwen3-moe-tiny\n- family: qwen3_moe\n")
    with pytest.raises(SpecError, match=r"'\(top level\)'"):
        load_spec(path)


def test_invalid_yaml_syntax_is_refused(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(TINY.read_text().replace("num_layers: 4", "num_layers: [4"))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert "not valid YAML" in str(info.value) and str(path) in str(info.value)


def test_nonexistent_path_is_refused(tmp_path, seed):
    path = tmp_path / f"missing-{seed}.yaml"
    with pytest.raises(SpecError, match="no such spec file") as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(SpecError, match="config.json"):
        load_spec(tmp_path)


# -- overrides --------------------------------------------------------------------------------------------


def test_overrides_edit_top_level_and_nested_fields(seed):
    rng = random.Random(seed)
    layers, top_k = rng.randint(1, 8), rng.randint(1, 16)
    spec, _ = load_spec(TINY, [f"num_layers={layers}", f"moe.top_k={top_k}", "rope.theta=5000"])
    assert (spec.num_layers, spec.moe.top_k, spec.rope.theta) == (layers, top_k, 5000.0)
    assert spec.moe.num_experts == 16 and spec.hidden_size == 256


@pytest.mark.parametrize("name", ["glm-5.2", "qwen3.6-35b-a3b"])
def test_fewer_layers_cut_the_per_layer_lists(name, seed):
    """`num_layers=N` below a real spec's count is its first N layers: the lists of one entry per
    layer keep their first N, the dense layers those below N; every other field is the spec's."""
    full, _ = load_spec(SPECS / f"{name}.yaml")
    n = random.Random(seed).randrange(4, full.num_layers)
    cut, _ = load_spec(SPECS / f"{name}.yaml", [f"num_layers={n}"])
    assert cut.num_layers == n and cut.layer_kinds == full.layer_kinds[:n]
    assert cut.moe.dense_layers == tuple(i for i in full.moe.dense_layers if i < n)
    assert cut.moe_layers == tuple(i for i in full.moe_layers if i < n)
    assert (cut.indexer is None) == (full.indexer is None)
    if full.indexer is not None:
        assert cut.indexer.layer_types == full.indexer.layer_types[:n]
    assert (cut.hidden_size, cut.vocab_size, cut.attention, cut.moe.num_experts) == \
        (full.hidden_size, full.vocab_size, full.attention, full.moe.num_experts)


def test_override_values_are_yaml_and_may_create_fields():
    spec, _ = load_spec(TINY, ["moe.dense_layers=[0, 2]", "moe.dense_intermediate_size=96"])
    assert spec.moe.dense_layers == (0, 2)
    assert spec.moe_layers == (1, 3)


def test_override_is_validated_like_the_file(seed):
    bad = random.Random(seed).randint(17, 99)
    with pytest.raises(SpecError, match=rf"'moe\.top_k' = {bad}"):
        load_spec(TINY, [f"moe.top_k={bad}"])
    with pytest.raises(SpecError, match="unknown field 'moe.topk'"):
        load_spec(TINY, ["moe.topk=2"])


@pytest.mark.parametrize("item", ["nonsense", "=4"])
def test_malformed_override_is_refused(item):
    with pytest.raises(SpecError, match="FIELD=VALUE") as info:
        load_spec(TINY, [item])
    assert repr(item) in str(info.value)


def test_override_through_a_scalar_field_is_a_spec_error():
    with pytest.raises(SpecError, match="num_layers"):
        load_spec(TINY, ["num_layers.x=1"])


def test_override_with_malformed_yaml_value_is_a_spec_error():
    with pytest.raises(SpecError, match="name"):
        load_spec(TINY, ["name=[unclosed"])


# -- size bounds ----------------------------------------------------------------------------------------------
# A damaged or hostile size (num_layers: 1000000000) once made the loader allocate without limit.

HYBRID = SPECS / "qwen3.6-moe-tiny.yaml"
BOUNDS = {"num_layers": spec_mod.MAX_LAYERS, "hidden_size": spec_mod.MAX_HIDDEN, "vocab_size": spec_mod.MAX_VOCAB,
          "attention.num_heads": spec_mod.MAX_HEADS, "attention.num_kv_heads": spec_mod.MAX_HEADS,
          "attention.head_dim": spec_mod.MAX_HEAD_DIM, "moe.num_experts": spec_mod.MAX_EXPERTS,
          "moe.top_k": spec_mod.MAX_TOP_K, "moe.expert_intermediate_size": spec_mod.MAX_INTERMEDIATE,
          "moe.shared_expert_intermediate_size": spec_mod.MAX_INTERMEDIATE,
          "moe.dense_intermediate_size": spec_mod.MAX_INTERMEDIATE,
          "max_position_embeddings": spec_mod.MAX_POSITIONS,
          "linear_attention.num_k_heads": spec_mod.MAX_HEADS, "linear_attention.num_v_heads": spec_mod.MAX_HEADS,
          "linear_attention.k_head_dim": spec_mod.MAX_HEAD_DIM, "linear_attention.v_head_dim": spec_mod.MAX_HEAD_DIM,
          "linear_attention.conv_kernel": spec_mod.MAX_CONV_KERNEL}


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_a_size_beyond_its_bound_is_refused_naming_field_and_value(field, tmp_path, seed):
    data = yaml.safe_load((HYBRID if field.startswith("linear_attention.") else TINY).read_text())
    rng = random.Random(seed)
    value = rng.choice([BOUNDS[field] + 1, 10**9, 10 ** rng.randint(10, 40)])
    set_field(data, field, value)
    path = _write(tmp_path, data)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: field '{field}' = {value!r}: expected at most {BOUNDS[field]}"), msg


def test_sizes_at_their_bounds_are_accepted():
    data = _tiny_dict()
    for field, bound in BOUNDS.items():
        if not field.startswith("linear_attention."):
            set_field(data, field, bound)
    spec = ModelSpec.from_dict(data)
    assert (spec.num_layers, spec.vocab_size, spec.moe.num_experts) == (
        spec_mod.MAX_LAYERS, spec_mod.MAX_VOCAB, spec_mod.MAX_EXPERTS)


def test_a_750b_class_model_is_well_within_the_bounds():
    """DeepSeek-V3/V4- and GLM-5-class shapes (61-78 layers, hidden 6144-7168, 256 experts of 2048,
    vocabularies under 160k, contexts of 160k-1M tokens): each at most a quarter of its bound."""
    data = _tiny_dict()
    shapes = {"num_layers": 78, "hidden_size": 7168, "vocab_size": 154880, "attention.num_heads": 128,
              "attention.num_kv_heads": 128, "attention.head_dim": 256, "moe.num_experts": 384, "moe.top_k": 8,
              "moe.expert_intermediate_size": 2048, "max_position_embeddings": 1 << 20}
    for field, value in shapes.items():
        set_field(data, field, value)
        assert value <= BOUNDS[field] // 4, field
    assert ModelSpec.from_dict(data).hidden_size == 7168


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_spec_is_within_the_bounds(path):
    assert load_spec(path)[0].num_layers <= spec_mod.MAX_LAYERS


@pytest.mark.parametrize("name", ["../../x", "a/b", "", ".", "..", "x" * 256, "a\\b", "nul\0byte"])
def test_a_name_that_is_not_one_file_name_is_refused(name):
    data = _tiny_dict()
    data["name"] = name
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(data, source="s")
    assert str(info.value).startswith("s: field 'name' = ") and "a plain file name" in str(info.value)


@pytest.mark.parametrize("field, value", [("norm.eps", ".inf"), ("norm.eps", ".nan"), ("norm.eps", "1.5"),
                                          ("rope.theta", ".inf"), ("rope.theta", ".nan")])
def test_non_finite_or_absurd_floats_are_refused(field, value):
    with pytest.raises(SpecError, match=f"'{re.escape(field)}'"):
        load_spec(TINY, [f"{field}={value}"])


def test_a_huge_value_is_cut_short_in_the_message():
    data = _tiny_dict()
    data["name"] = 123
    data["family"] = "x" * 10**6
    with pytest.raises(SpecError) as info:
        ModelSpec.from_dict(data, source="s")
    assert len(str(info.value)) < 1000


# -- HF config.json ---------------------------------------------------------------------------------------


def _random_shape(rng: random.Random) -> TinyShape:
    heads = rng.choice([2, 4, 6, 8])
    layers = rng.randint(2, 4)
    experts = rng.randint(4, 12)
    return TinyShape(
        hidden=rng.choice([32, 48, 64]), intermediate=8 * rng.randint(2, 6), layers=layers, heads=heads,
        kv_heads=rng.choice([k for k in (1, 2, 3, 4) if heads % k == 0]), head_dim=rng.choice([8, 16, 24]),
        experts=experts, top_k=rng.randint(1, experts), vocab=rng.randint(TOKENIZER_TOKENS, 400),
        norm_topk_prob=rng.random() < 0.5, mlp_only_layers=tuple(sorted(rng.sample(range(layers), 1))),
        dense_intermediate=8 * rng.randint(4, 12), tie_embeddings=rng.random() < 0.5)


def _hf_checkpoint(tmp_path: Path, shape: TinyShape, theta: float, seed: int = 0) -> tuple[Path, Qwen3MoeConfig]:
    """A checkpoint of the shape, its weights from `seed` (the tests below read only its config)."""
    model = build_model(shape, seed=seed)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    ckpt = save_checkpoint(model, tmp_path / "ckpt", "fused", 1)
    return ckpt, Qwen3MoeConfig.from_pretrained(ckpt)


def test_spec_from_hf_config_matches_the_transformers_config(tmp_path, seed):
    rng = random.Random(seed)
    ckpt, cfg = _hf_checkpoint(tmp_path, _random_shape(rng), float(rng.randint(1000, 10**6)), seed)
    spec, checkpoint = load_spec(ckpt)
    assert checkpoint == ckpt
    assert spec.family == "qwen3_moe"
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size)
    a = spec.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    m = spec.moe
    assert (m.num_experts, m.top_k, m.expert_intermediate_size) == (
        cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size)
    assert m.dense_layers == tuple(cfg.mlp_only_layers)
    assert m.dense_intermediate_size == cfg.intermediate_size
    assert spec.moe_layers == tuple(i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers)
    assert m.norm_topk_prob == cfg.norm_topk_prob
    assert spec.tie_word_embeddings == cfg.tie_word_embeddings
    assert spec.rope.theta == cfg.rope_parameters["rope_theta"]
    assert spec.norm.eps == cfg.rms_norm_eps
    assert spec.max_position_embeddings == cfg.max_position_embeddings


def _edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_decoder_sparse_step_makes_the_other_layers_dense(tmp_path):
    ckpt, _ = _hf_checkpoint(tmp_path, TinyShape(layers=4), 10000.0)
    _edit_config(ckpt, decoder_sparse_step=2, mlp_only_layers=[])
    cfg = Qwen3MoeConfig.from_pretrained(ckpt)
    spec, _ = load_spec(ckpt)
    assert spec.moe_layers == (1, 3)
    assert spec.moe.dense_layers == (0, 2)
    assert spec.moe.dense_intermediate_size == cfg.intermediate_size


def test_non_qwen3_moe_config_is_refused_naming_model_type(tmp_path):
    ckpt, _ = _hf_checkpoint(tmp_path, TinyShape(), 10000.0)
    _edit_config(ckpt, model_type="llama")
    with pytest.raises(SpecError, match=r"'model_type' = 'llama'"):
        load_spec(ckpt)


def test_hf_config_missing_a_required_field_is_refused(tmp_path):
    ckpt, _ = _hf_checkpoint(tmp_path, TinyShape(), 10000.0)
    _edit_config(ckpt, moe_intermediate_size=DELETE)
    with pytest.raises(SpecError, match="'moe_intermediate_size'"):
        load_spec(ckpt)


def test_absent_norm_topk_prob_follows_the_transformers_default(tmp_path):
    ckpt, _ = _hf_checkpoint(tmp_path, TinyShape(norm_topk_prob=True), 10000.0)
    _edit_config(ckpt, norm_topk_prob=DELETE)
    spec, _ = load_spec(ckpt)
    assert spec.moe.norm_topk_prob == Qwen3MoeConfig.from_pretrained(ckpt).norm_topk_prob



def test_a_config_json_with_absurd_layer_counts_is_refused_without_looping(tmp_path: Path):
    """num_hidden_layers = 10^12 in a checkpoint's config.json: refused by the spec's bound, at once."""
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 10**12, "hidden_size": 64, "vocab_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="num_layers"):
        load_spec(tmp_path)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("field", ["hidden_size", "moe.expert_intermediate_size"])
def test_4bit_experts_need_sizes_that_their_packing_holds(fmt, field, seed):
    """FTW packs 4-bit codes 64 columns at a time: another size is refused naming its field, before
    any weight is read; a multiple of 64 loads."""
    d = _tiny_dict() | {"expert_format": fmt}
    ModelSpec.from_dict(d)  # the tiny sizes (256, 128) are multiples of 64
    size = 64 * random.Random(seed).randrange(1, 8) + 32
    set_field(d, field, size)
    expected = rf"'{re.escape(field)}' = {size}: expected a multiple of 64 for expert_format {fmt}"
    with pytest.raises(SpecError, match=expected):
        ModelSpec.from_dict(d)
