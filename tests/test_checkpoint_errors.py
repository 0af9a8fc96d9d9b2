"""Broken checkpoints are refused with a CheckpointError that names the file or tensor at fault (non-finite
weights included); a checkpoint without a readable tokenizer.json of its vocabulary is refused before any
weight is read; both fused expert layouts compile to the same bytes; a failed compile leaves the engine
already in place."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.compile.checkpoint import CheckpointError
from ftc.compile.ftw_writer import FtwWriter
from ftc.compile.pipeline import CompileOptions, compile_engine, sampling_defaults
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.formats.base import expert_shapes
from ftc_runtime.io.ftw import FtwHeader
from ftc_runtime.models import family
from ftc_runtime.spec import SpecError

from hf_models import TinyShape, build_model, save_checkpoint
from hf_tokenizer import save_tokenizer

# hidden != 2 * intermediate and != intermediate, so a transposed fused tensor has another shape; both
# are multiples of 32, as the kernels need.
SHAPE = TinyShape(hidden=64, intermediate=96, layers=2, experts=6, top_k=2)
Tensors = dict[str, torch.Tensor]


def _checkpoint(root: Path, rng: random.Random, layout: str = "fused", shards: int = 1) -> Path:
    """Always a directory named 'ckpt' (the model name), so that every engine shares one kernel build."""
    return save_checkpoint(build_model(SHAPE, seed=rng.randrange(2**31)), root / "ckpt", layout, shards)


def _compile(ckpt: Path, out: Path, force: bool = False) -> Path:
    return compile_engine(CompileOptions(source=ckpt, target="auto", output=out, force=force))


def _shard_of(ckpt: Path, tensor: str) -> Path:
    index = ckpt / "model.safetensors.index.json"
    if not index.is_file():
        return ckpt / "model.safetensors"
    return ckpt / json.loads(index.read_text())["weight_map"][tensor]


def _rewrite(path: Path, edit: Callable[[Tensors], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _dense_names(ckpt: Path) -> list[str]:
    spec, _ = load_spec(ckpt)
    return list(family(spec.family).dense_tensor_shapes(spec))


def _expert_tensor(rng: random.Random) -> str:
    """One expert's tensor in the per-expert layout."""
    return (f"model.layers.{rng.randrange(SHAPE.layers)}.mlp.experts.{rng.randrange(SHAPE.experts)}."
            f"{rng.choice(['gate_proj', 'up_proj', 'down_proj'])}.weight")


def _compile_error(ckpt: Path, out: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        _compile(ckpt, out)
    assert not out.exists()
    return str(info.value)


def test_missing_shard_is_named(tmp_path, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng, shards=3)
    shard = rng.choice(sorted(ckpt.glob("model-*.safetensors")))
    shard.unlink()
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert shard.name in msg and "missing" in msg


@pytest.mark.parametrize("shards", [1, 2])
def test_missing_dense_tensor_is_named(tmp_path, shards, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng, shards=shards)
    name = rng.choice(_dense_names(ckpt))
    _rewrite(_shard_of(ckpt, name), lambda t: t.pop(name))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} " in msg


def test_dense_tensor_of_wrong_shape_is_named_with_both_shapes(tmp_path, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    name = rng.choice([n for n in _dense_names(ckpt) if n.endswith("proj.weight")])
    shapes = {}

    def truncate(t: Tensors) -> None:
        shapes["good"] = tuple(t[name].shape)
        t[name] = t[name][:-1].contiguous()
        shapes["bad"] = tuple(t[name].shape)

    _rewrite(_shard_of(ckpt, name), truncate)
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} " in msg
    assert str(shapes["bad"]) in msg and str(shapes["good"]) in msg


@pytest.mark.parametrize("which", ["gate_up_proj", "down_proj"])
def test_fused_expert_tensor_of_wrong_shape_is_named_with_both_shapes(tmp_path, which, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    name = f"model.layers.{rng.randrange(SHAPE.layers)}.mlp.experts.{which}"
    shapes = {}

    def truncate(t: Tensors) -> None:
        shapes["good"] = tuple(t[name].shape)
        t[name] = t[name][:, :-1].contiguous()
        shapes["bad"] = tuple(t[name].shape)

    _rewrite(ckpt / "model.safetensors", truncate)
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} " in msg
    assert str(shapes["bad"]) in msg and str(shapes["good"]) in msg


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_dense_tensor_with_integer_dtype_is_named(tmp_path, dtype, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    name = rng.choice(_dense_names(ckpt))
    _rewrite(_shard_of(ckpt, name), lambda t: t.update({name: t[name].to(dtype)}))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} " in msg and str(dtype) in msg


def test_expert_tensor_with_integer_dtype_is_named(tmp_path, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng, layout="per_expert")
    name = _expert_tensor(rng)
    _rewrite(ckpt / "model.safetensors", lambda t: t.update({name: t[name].to(torch.int32)}))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} " in msg and "torch.int32" in msg


@pytest.mark.parametrize("keep_index", [False, True])
def test_directory_without_safetensors_is_refused(tmp_path, keep_index, seed):
    ckpt = _checkpoint(tmp_path, random.Random(seed), shards=2)
    for path in ckpt.glob("*.safetensors"):
        path.unlink()
    if not keep_index:
        (ckpt / "model.safetensors.index.json").unlink()
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert str(ckpt) in msg
    assert ("model.safetensors" in msg) if not keep_index else ("missing" in msg)


# Non-finite weights: refused at compile, naming the checkpoint tensor (and the expert of a fused one).
NONFINITE = {"nan": (torch.bfloat16, float("nan")), "inf": (torch.bfloat16, float("inf")),
             "-inf": (torch.bfloat16, -float("inf")), "fp32_beyond_bf16": (torch.float32, 3.4e38)}


def _poison(t: Tensors, name: str, kind: str, rng: random.Random, entry: int | None = None) -> None:
    """One value of tensor `name` (of its `entry` along dim 0, if given) made non-finite in bf16."""
    dtype, value = NONFINITE[kind]
    w = t[name].to(dtype)
    part = w[entry] if entry is not None else w
    part.view(-1)[rng.randrange(part.numel())] = value
    t[name] = w


@pytest.mark.parametrize("kind", sorted(NONFINITE))
def test_non_finite_dense_tensor_is_named(tmp_path, kind, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng, shards=2)
    name = rng.choice(_dense_names(ckpt))
    _rewrite(_shard_of(ckpt, name), lambda t: _poison(t, name, kind, rng))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert msg.startswith(f"{_shard_of(ckpt, name)}: tensor {name} has 1 NaN or Inf values of "), msg


@pytest.mark.parametrize("which", ["gate_up_proj", "down_proj"])
def test_non_finite_value_in_a_fused_expert_names_tensor_and_expert(tmp_path, which, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    name = f"model.layers.{rng.randrange(SHAPE.layers)}.mlp.experts.{which}"
    expert = rng.randrange(SHAPE.experts)
    _rewrite(ckpt / "model.safetensors", lambda t: _poison(t, name, rng.choice(sorted(NONFINITE)), rng, expert))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} (entry {expert} along dim 0) has 1 NaN or Inf values" in msg, msg


def test_non_finite_value_in_a_per_expert_tensor_is_named(tmp_path, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng, layout="per_expert")
    name = _expert_tensor(rng)
    _rewrite(ckpt / "model.safetensors", lambda t: _poison(t, name, rng.choice(sorted(NONFINITE)), rng))
    msg = _compile_error(ckpt, tmp_path / "engine")
    assert f"tensor {name} has 1 NaN or Inf values" in msg, msg


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
def test_ftw_writer_refuses_a_non_finite_row(tmp_path, kind, seed):
    """The expert pool's rows as they are written, from any weight source."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    header = FtwHeader.create("bf16", 2, 3, 64, 32)
    shapes = expert_shapes(header.hidden, header.intermediate)
    writer = FtwWriter(tmp_path / "e.ftw", header)
    row, bank = rng.randrange(header.num_rows), rng.choice(sorted(shapes))
    for _ in range(row):
        writer.append({name: torch.randn(shape, generator=g).bfloat16() for name, shape in shapes.items()})
    rows = {name: torch.randn(shape, generator=g).bfloat16() for name, shape in shapes.items()}
    _poison(rows, bank, kind, rng)
    layer, expert = divmod(row, header.num_experts)
    with pytest.raises(ValueError, match=re.escape(f"expert {row} (MoE layer {layer}, expert {expert}), bank "
                                                   f"'{bank}': 1 NaN or Inf values")):
        writer.append(rows)


def _experts_sha(engine: Path) -> str:
    return json.loads((engine / "engine.json").read_text())["files"]["experts.ftw"]["sha256"]


def _transpose_experts(t: Tensors) -> None:
    for name in [n for n in t if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        t[name] = t[name].transpose(1, 2).contiguous()


def test_transposed_fused_layout_compiles_to_the_same_experts(tmp_path, seed):
    ckpt = _checkpoint(tmp_path, random.Random(seed))
    base = _compile(ckpt, tmp_path / "base")
    _rewrite(ckpt / "model.safetensors", _transpose_experts)
    gate_up = load_file(str(ckpt / "model.safetensors"))["model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(gate_up.shape) == (SHAPE.experts, SHAPE.hidden, 2 * SHAPE.intermediate)
    transposed = _compile(ckpt, tmp_path / "transposed")
    assert _experts_sha(transposed) == _experts_sha(base)


def test_per_expert_layout_compiles_to_the_same_experts_as_fused(tmp_path, seed):
    rng = random.Random(seed)
    model = build_model(SHAPE, seed=rng.randrange(2**31))
    fused = _compile(save_checkpoint(model, tmp_path / "fused" / "ckpt", "fused", 1), tmp_path / "e1")
    split = _compile(save_checkpoint(model, tmp_path / "split" / "ckpt", "per_expert", 2), tmp_path / "e2")
    assert _experts_sha(split) == _experts_sha(fused)
    other = _compile(_checkpoint(tmp_path / "other", rng), tmp_path / "e3")
    assert _experts_sha(other) != _experts_sha(fused)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _late_failure(tmp_path: Path, rng: random.Random) -> Path:
    """A checkpoint that passes every up-front check and fails while its dense tensors are written."""
    ckpt = _checkpoint(tmp_path / "broken", rng)
    name = rng.choice(_dense_names(ckpt))
    _rewrite(ckpt / "model.safetensors", lambda t: t.update({name: t[name].to(torch.int32)}))
    return ckpt


@pytest.fixture
def good_engine_then_failed_compile(tmp_path, seed) -> tuple[Path, dict[str, str], torch.Tensor, list[int]]:
    rng = random.Random(seed)
    out = _compile(_checkpoint(tmp_path, rng), tmp_path / "engine")
    ids = [rng.randrange(SHAPE.vocab) for _ in range(6)]
    before, logits = _tree_digest(out), Engine.load(out).logits(ids)
    with pytest.raises(CheckpointError):
        _compile(_late_failure(tmp_path, rng), out, force=True)
    return out, before, logits, ids


def test_failed_compile_leaves_the_previous_engine_intact(good_engine_then_failed_compile):
    out, before, logits, ids = good_engine_then_failed_compile
    assert _tree_digest(out) == before
    assert torch.equal(Engine.load(out).logits(ids), logits)
    assert not list(out.parent.glob(f".{out.name}.old*"))


def test_failed_compile_leaves_no_partial_directory(good_engine_then_failed_compile):
    out = good_engine_then_failed_compile[0]
    assert not list(out.parent.glob(f".{out.name}.partial*"))


def test_generation_config_gives_the_engines_sampling_defaults(tmp_path):
    """temperature, top_p, top_k and the penalties of generation_config.json; do_sample false:
    greedy, penalties kept (HF's greedy search applies them); none: no defaults; a bad value or file
    is refused naming it."""
    assert sampling_defaults(tmp_path) == {} and sampling_defaults(None) == {}
    config = {"temperature": round(random.uniform(0.1, 1.5), 3), "top_p": round(random.uniform(0.5, 1), 3),
              "top_k": random.randint(0, 100), "do_sample": True, "bos_token_id": 1, "repetition_penalty": 1.05,
              "presence_penalty": round(random.uniform(-2, 2), 3), "frequency_penalty": None}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    kept = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty")
    assert sampling_defaults(tmp_path) == {k: config[k] for k in kept}
    (tmp_path / "generation_config.json").write_text(json.dumps(config | {"do_sample": False}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "repetition_penalty": 1.05,
                                           "presence_penalty": config["presence_penalty"]}
    bads = [(config | {"top_p": 1.5}, "top_p"), (config | {"top_k": "20"}, "top_k"), ("{oops", "JSON"),
            (config | {"repetition_penalty": 0}, "repetition_penalty"),
            (config | {"frequency_penalty": 2.5}, "frequency_penalty")]
    for bad, says in bads:
        (tmp_path / "generation_config.json").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(SpecError, match=f"generation_config.json: .*{says}"):
            sampling_defaults(tmp_path)


# -- the checkpoint's tokenizer.json: checked before any weight is read ------------------------------------

ROUTES = ["folder", "spec_and_checkpoint_option", "spec_naming_the_checkpoint"]


def _compile_args(ckpt: Path, route: str, tmp_path: Path) -> list[str]:
    """`ftc compile` of the checkpoint given as the model (a folder), or as a spec YAML of its model
    with --checkpoint, or as a spec that names it (its `checkpoint` field)."""
    if route == "folder":
        return [str(ckpt)]
    data = load_spec(ckpt)[0].to_dict()
    data["checkpoint"] = str(ckpt) if route == "spec_naming_the_checkpoint" else None
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(data))
    return [str(spec)] + (["--checkpoint", str(ckpt)] if route == "spec_and_checkpoint_option" else [])


def _refused(args: list[str], out: Path) -> str:
    """The one `error:` line of a compile that must stop before it starts: exit status 1, no traceback,
    nothing at -o or beside it (no staging directory)."""
    r = CliRunner().invoke(app, ["compile", *args, "-o", str(out)])
    assert r.exit_code == 1, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return lines[0]


@pytest.mark.parametrize("route", ROUTES)
def test_checkpoint_without_tokenizer_is_refused_before_its_weights_are_read(tmp_path, route, seed):
    ckpt = _checkpoint(tmp_path, random.Random(seed))
    args = _compile_args(ckpt, route, tmp_path)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "model.safetensors").write_bytes(b"not read")  # a read weights file would be the error
    line = _refused(args, tmp_path / "build" / "engine")
    assert f"error: {ckpt}: no tokenizer.json" in line and "save_pretrained" in line, line


@pytest.mark.parametrize("route", ROUTES)
def test_tokenizer_larger_than_the_vocabulary_is_refused_with_both_sizes(tmp_path, route, seed):
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    args = _compile_args(ckpt, route, tmp_path)
    extra = rng.randint(SHAPE.vocab, 2 * SHAPE.vocab)  # after the specials: those stay within the vocabulary
    save_tokenizer(ckpt, extra_tokens=extra)
    top = 256 + 3 + extra - 1
    line = _refused(args, tmp_path / "build" / "engine")
    assert f"error: {ckpt / 'tokenizer.json'}: {top + 1} tokens with ids up to {top}" in line, line
    assert f"vocab_size is {SHAPE.vocab}" in line, line


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("content", [b"{oops", b"{}", b'{"model": {"type": "BPE"}}', b"\xff\xfe\x00"])
def test_unreadable_tokenizer_is_refused_naming_it(tmp_path, route, content, seed):
    ckpt = _checkpoint(tmp_path, random.Random(seed))
    args = _compile_args(ckpt, route, tmp_path)
    (ckpt / "tokenizer.json").write_bytes(content)
    line = _refused(args, tmp_path / "build" / "engine")
    assert line.startswith(f"error: {ckpt / 'tokenizer.json'}: not a readable tokenizer ("), line


@pytest.mark.parametrize("route", ROUTES[1:])
def test_a_special_token_at_another_id_is_refused_naming_it(tmp_path, route, seed):
    """A spec whose special token the checkpoint's tokenizer holds at another id (or not as one
    token) is refused before any weight is read, naming the token and both ids."""
    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    args = _compile_args(ckpt, route, tmp_path)
    spec_file = Path(args[0])
    data = yaml.safe_load(spec_file.read_text())
    name = rng.choice(sorted(data["tokens"]["special"]))
    wrong = rng.choice([i for i in range(256) if i != data["tokens"]["special"][name]])
    data["tokens"]["special"][name] = wrong
    spec_file.write_text(yaml.safe_dump(data))
    (ckpt / "model.safetensors").write_bytes(b"not read")
    line = _refused(args, tmp_path / "build" / "engine")
    assert f"error: {ckpt / 'tokenizer.json'}: special token {name!r} is id " in line, line
    assert f"tokens.special gives it id {wrong}" in line, line


def test_the_engine_marks_the_specs_special_tokens_special(tmp_path, seed):
    """A release whose turn marker is an added token marked `"special": false` (DeepSeek's
    `<｜User｜>`): the spec lists it as special, so the engine's tokenizer marks it special, and a
    client's text holding it encodes as text, not as the marker, where the checkpoint's tokenizer
    would make it the marker."""
    from tokenizers import AddedToken, Tokenizer

    from ftc_runtime.chat.tokenizer import Tokenizer as EngineTokenizer

    rng = random.Random(seed)
    ckpt = _checkpoint(tmp_path, rng)
    marker = "<｜User｜>"
    source = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    source.add_tokens([AddedToken(marker, special=False, normalized=False)])
    source.save(str(ckpt / "tokenizer.json"))
    marker_id = source.token_to_id(marker)
    args = _compile_args(ckpt, "spec_naming_the_checkpoint", tmp_path)
    data = yaml.safe_load(Path(args[0]).read_text())
    data["tokens"]["special"][marker] = marker_id
    Path(args[0]).write_text(yaml.safe_dump(data, allow_unicode=True))
    text = f"{'ab' * rng.randrange(1, 4)}{marker}cd"
    assert marker_id in EngineTokenizer(ckpt / "tokenizer.json").encode_text(text)  # the premise
    engine = compile_engine(CompileOptions(source=Path(args[0]), target="auto", output=tmp_path / "engine"))
    tokenizer = EngineTokenizer(engine / "tokenizer.json")
    assert tokenizer.special_tokens[marker] == marker_id
    assert marker_id not in tokenizer.encode_text(text) and tokenizer.decode(tokenizer.encode_text(text)) == text
    assert tokenizer.encode(text).count(marker_id) == 1
