"""A damaged or mismatched engine directory is refused before serving, with the file and the fault."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.artifact import ArtifactError
from ftc_runtime.experts.cpu_kernel import KernelError
from ftc_runtime.io.ftw import FtwError, read_header

SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine") / "tiny"
    return compile_engine(CompileOptions(source=SPEC, random_weights=True, output=out,
                                         overrides=("num_layers=2",)))


@pytest.fixture
def copy(engine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(engine, tmp_path / "copy"))


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x5A
    path.write_bytes(bytes(data))


def test_good_engine_loads_and_checks_its_inputs(engine: Path):
    e = Engine.load(engine)
    assert e.logits([1, 2, 3]).shape == (3, e.spec.vocab_size)
    with pytest.raises(ValueError, match="empty"):
        e.logits([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.logits([1, e.spec.vocab_size])


def test_truncated_expert_file(copy: Path, seed: int):
    path = copy / "experts.ftw"
    path.write_bytes(path.read_bytes()[: random.Random(seed).randrange(1, path.stat().st_size)])
    with pytest.raises(ArtifactError, match=r"experts\.ftw: truncated"):
        Engine.load(copy)


def test_corrupted_expert_row(copy: Path, seed: int):
    rng = random.Random(seed)
    header, _ = read_header(copy / "experts.ftw")
    row = rng.randrange(header.num_rows)
    bank = header.bank("down")
    _flip(copy / "experts.ftw", header.data_offset + row * header.expert_stride + bank.offset
          + rng.randrange(bank.row_bytes))
    with pytest.raises(FtwError, match=rf"experts\.ftw: corrupted: bank 'down' row {row} "):
        Engine.load(copy)


@pytest.mark.parametrize("name", ["dense.safetensors", "tokenizer.json", "lib/libftc_kernels.so"])
def test_corrupted_or_missing_small_files(copy: Path, name: str, seed: int):
    path = copy / name
    _flip(path, random.Random(seed).randrange(path.stat().st_size))
    with pytest.raises(ArtifactError, match=rf"{name}: corrupted: sha256"):
        Engine.load(copy)
    path.unlink()
    with pytest.raises(ArtifactError, match=rf"{name}: missing from the engine"):
        Engine.load(copy)


def test_manifest_damage(copy: Path):
    manifest = copy / "engine.json"
    good = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(good)[:-10])
    with pytest.raises(ArtifactError, match=r"engine\.json: corrupted"):
        Engine.load(copy)
    manifest.write_text(json.dumps(good | {"format_version": 99, "ftc_version": "9.9.9"}))
    with pytest.raises(ArtifactError, match=r"format version 99 \(written by ftc '9\.9\.9'\) is not supported .*: "
                                            "upgrade ftc"):
        Engine.load(copy)
    manifest.write_text(json.dumps(good | {"format_version": good["format_version"] - 1}))
    with pytest.raises(ArtifactError, match="is not supported .*: recompile the engine"):
        Engine.load(copy)
    manifest.write_text(json.dumps(good | {"spec": good["spec"] | {"hidden_size": -5}}))
    with pytest.raises(ArtifactError, match="hidden_size"):
        Engine.load(copy)
    manifest.unlink()
    with pytest.raises(ArtifactError, match="not an ftc engine"):
        Engine.load(copy)


def test_library_of_another_isa_is_refused(copy: Path):
    manifest = copy / "engine.json"
    good = json.loads(manifest.read_text())
    other = "avx2" if good["plan"]["isa"] == "avx512_bf16" else "avx512_bf16"
    manifest.write_text(json.dumps(good | {"plan": good["plan"] | {"isa": other}}))
    with pytest.raises(KernelError, match="built for|lacks"):
        Engine.load(copy)


def test_engine_json_of_an_older_compile_loads(copy: Path):
    """Fields added since (the plan's prompt chunks, the chat template, experts_in_memory) take their
    defaults: the stricter checks of engine.json refuse damage, not older engines."""
    manifest = copy / "engine.json"
    m = json.loads(manifest.read_text())
    for key in ("prefill_chunk", "prefill_stream_min_tokens"):
        del m["plan"][key]
    del m["files"]["chat_template.jinja"], m["experts_in_memory"]
    manifest.write_text(json.dumps(m))
    e = Engine.load(copy)
    assert (e.prefill_chunk, e.manifest.plan.prefill_stream_min_tokens, e.chat_template) == (8192, 64, None)
    assert e.logits([1, 2]).shape == (2, e.spec.vocab_size)
