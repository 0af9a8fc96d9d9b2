"""DeepSeek-V4's spec mapping and checkpoint layout (`models/deepseek_v4/loader.py`) against
transformers: random tiny configs read as transformers reads them (its config's layer kinds, hash
layers and ropes, from the current fields and from the released checkpoints' older ones), the
non-expert tensors' names and shapes equal to those of transformers' model built from the same
config and read from the released and the converted layout; bad fields refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from ftc.compile.checkpoint import SafetensorsCheckpoint
from ftc_runtime.models.deepseek_v4.loader import (
    HF_LAYER_TYPES,
    DeepseekV4Layout,
    check_spec,
    dense_tensor_shapes,
    spec_from_hf,
)
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.spec import ModelSpec, SpecError, checker

KINDS = list(HF_LAYER_TYPES)


def random_fields(rng: random.Random) -> dict:
    """A tiny DeepSeek-V4 config's fields in the current form, drawn at random."""
    n, heads, groups = rng.randint(2, 6), rng.choice([2, 4, 8]), rng.choice([1, 2])
    return {"vocab_size": rng.randint(50, 300), "hidden_size": 64, "moe_intermediate_size": 32,
            "num_hidden_layers": n, "num_attention_heads": heads, "head_dim": rng.choice([32, 64]),
            "q_lora_rank": rng.choice([16, 24]), "n_routed_experts": 8, "num_experts_per_tok": rng.randint(1, 4),
            "o_groups": groups, "o_lora_rank": rng.choice([8, 16]), "index_n_heads": rng.choice([2, 4]),
            "index_head_dim": 16, "index_topk": rng.randint(2, 8), "sliding_window": rng.choice([4, 8]),
            "layer_types": [rng.choice(KINDS) for _ in range(n)],
            "compress_rates": {"compressed_sparse_attention": rng.choice([2, 4]),
                               "heavily_compressed_attention": rng.choice([8, 16])},
            "mlp_layer_types": ["hash_moe"] * (h := rng.randint(0, n)) + ["moe"] * (n - h),
            "partial_rotary_factor": 0.25, "hc_mult": rng.choice([2, 4]), "hc_sinkhorn_iters": rng.randint(1, 20),
            "routed_scaling_factor": rng.uniform(1, 3), "swiglu_limit": rng.uniform(5, 20),
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": rng.choice([1e4, 5e4])},
                                "compress": {"rope_type": "yarn", "rope_theta": 160000.0,
                                             "factor": rng.choice([4.0, 16.0]),
                                             "original_max_position_embeddings": 4096, "attention_factor": 1.0}}}


def read(fields: dict, tmp_path: Path) -> ModelSpec:
    """The spec of a checkpoint directory whose config.json holds `fields` (model_type deepseek_v4)."""
    where = tmp_path / "config.json"
    where.write_text(json.dumps({"model_type": "deepseek_v4"} | fields))
    spec = ModelSpec.from_dict(spec_from_hf(HfConfig(json.loads(where.read_text()), where)), str(where))
    check_spec(spec, checker(str(where)))
    return spec


def test_a_random_config_maps_as_transformers_reads_it(tmp_path, seed):
    rng = random.Random(seed)
    for trial in range(3):
        fields = random_fields(rng)
        spec, hf = read(fields, tmp_path), DeepseekV4Config(**fields)
        c, what = spec.compressed, f"trial {trial}: {fields}"
        assert list(c.layer_types) == [HF_LAYER_TYPES[t] for t in hf.layer_types], what
        assert [i for i, t in enumerate(hf.mlp_layer_types) if t == "hash_moe"] == list(spec.moe.hash_layers), what
        assert (c.csa_rate, c.hca_rate) == (hf.compress_rates["compressed_sparse_attention"],
                                            hf.compress_rates["heavily_compressed_attention"]), what
        assert c.rope_dim == hf.qk_rope_head_dim and spec.rope.theta == hf.rope_parameters["main"]["rope_theta"], what
        compress = hf.rope_parameters["compress"]
        assert (c.compress_theta, c.compress_yarn.factor) == (compress["rope_theta"], compress["factor"]), what
        assert spec.hyper_connections.streams == hf.hc_mult and spec.moe.swiglu_limit == hf.swiglu_limit, what


def test_the_non_expert_tensors_are_transformers_own(tmp_path, seed):
    """Names and shapes of every tensor of transformers' model but the routed experts."""
    rng = random.Random(seed)
    for trial in range(2):
        fields = random_fields(rng)
        fields["layer_types"][rng.randrange(len(fields["layer_types"]))] = "compressed_sparse_attention"
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**fields))
        want = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".mlp.experts." not in k}
        assert dense_tensor_shapes(read(fields, tmp_path)) == want, f"trial {trial}: {fields}"


def test_the_released_configs_older_fields_map_as_their_current_form(tmp_path, seed):
    """`compress_ratios` per layer, `num_hash_layers`, `qk_rope_head_dim`, `rope_theta`,
    `compress_rope_theta` and a top-level YaRN (the compressed entries' only), as transformers
    folds them."""
    rng = random.Random(seed)
    fields = random_fields(rng)
    n = fields["num_hidden_layers"]
    ratios = [rng.choice([0, 4, 128]) for _ in range(n)]
    old = {k: v for k, v in fields.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                          "partial_rotary_factor", "rope_parameters")}
    old |= {"compress_ratios": ratios, "num_hash_layers": rng.randint(0, n), "qk_rope_head_dim": 16,
            "rope_theta": 20000.0, "compress_rope_theta": 80000.0,
            "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                             "beta_fast": 16.0, "beta_slow": 2.0}}
    spec, hf = read(old, tmp_path), DeepseekV4Config(**old)
    assert list(spec.compressed.layer_types) == [HF_LAYER_TYPES[t] for t in hf.layer_types]
    assert list(spec.moe.hash_layers) == [i for i, t in enumerate(hf.mlp_layer_types) if t == "hash_moe"]
    assert spec.compressed.rope_dim == hf.qk_rope_head_dim == 16
    assert spec.rope.theta == hf.rope_parameters["main"]["rope_theta"] == 20000.0
    compress, yarn = hf.rope_parameters["compress"], spec.compressed.compress_yarn
    assert spec.compressed.compress_theta == compress["rope_theta"] == 80000.0
    assert (yarn.factor, yarn.original_max_position, yarn.beta_fast, yarn.beta_slow) == (
        compress["factor"], compress["original_max_position_embeddings"], compress["beta_fast"],
        compress["beta_slow"])


@pytest.mark.parametrize("edit,message", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types' has 'full_attention'"),
    ({"compress_ratios": [0, 64], "layer_types": None}, "'compress_ratios' has 64"),
    ({"mlp_layer_types": ["moe", "dense"]}, "'mlp_layer_types' has 'dense'"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {"rope_type": "default"}}},
     "the main rope's type 'yarn'"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "yarn", "factor": 4.0,
                                                                         "original_max_position_embeddings": 64}}},
     "YaRN attention_factor None is not supported"),
    ({"rope_parameters": {"main": {"partial_rotary_factor": 0.25}, "compress": {"partial_rotary_factor": 0.5}}},
     "the compress rope's partial_rotary_factor 0.5 differs"),
    ({"o_groups": 3}, "field 'compressed.o_groups' = 3"),
    ({"n_shared_experts": 2}, "field 'moe.num_shared_experts' = 2"),
])
def test_bad_fields_are_refused_by_name(tmp_path, edit, message):
    fields = {"vocab_size": 100, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "head_dim": 32, "n_routed_experts": 8, "o_groups": 2,
              "layer_types": ["sliding_attention", "compressed_sparse_attention"]} | edit
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read({k: v for k, v in fields.items() if v is not None}, tmp_path)


@pytest.mark.parametrize("layout", ["released", "released without model.", "converted"])
def test_every_non_expert_tensor_is_read_from_either_layout(tmp_path, layout, seed):
    """transformers' model saved as DeepSeek released it (`save_pretrained` writes the original
    names; the release itself has no "model." prefix) and as transformers names it: each tensor of
    `dense_tensor_shapes` is found under its canonical name, bit for bit (the hash layers' int64
    `tid2eid` too, which the compiler's bf16 reading does not take yet)."""
    rng = random.Random(seed)
    fields = random_fields(rng)
    fields["layer_types"][:3] = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"][
        :len(fields["layer_types"])]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**fields))
    want = model.state_dict()
    ckpt = tmp_path / "ckpt"
    if layout == "converted":
        ckpt.mkdir()
        save_file({k: v.contiguous() for k, v in want.items()}, ckpt / "model.safetensors")
    else:
        model.save_pretrained(ckpt)
        if layout == "released without model.":
            (path,) = ckpt.glob("*.safetensors")
            tensors = load_file(path)
            assert "model.layers.0.attn.wq_a.weight" in tensors  # the original names, as released
            for f in ckpt.glob("*.safetensors*"):
                f.unlink()
            save_file({k.removeprefix("model."): v for k, v in tensors.items()}, ckpt / "model.safetensors")
    spec = read(fields, tmp_path)
    reader = SafetensorsCheckpoint(ckpt)
    layout_ = DeepseekV4Layout(reader, spec)
    for name, shape in dense_tensor_shapes(spec).items():
        assert name in layout_, f"{layout}: {name} not found"
        stored = reader.raw(layout_.name(name))  # as stored: `get` would round to bf16
        assert layout_.shape(name) == shape and torch.equal(stored, want[name]), f"{layout}: {name}"
