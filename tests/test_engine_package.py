"""`ftc package`: an engine as a folder of expert shards (or one tar), loaded as the engine it came
from. The shards are held to the bytes of experts.ftw and to their size limit; the packaged engine
gives the original's logits bit for bit (folder, archive, a Hub cache's snapshot); a tampered,
missing, truncated or wrongly hashed shard is refused with the shard named."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftc.package import package_engine, shard_cuts
from ftc_runtime import Engine
from ftc_runtime.artifact import ArtifactError, EngineManifest, check_engine
from ftc_runtime.engine_source import resolve_engine
from ftc_runtime.io import ftw

from conftest import seed_for
from slot_checks import near_best_share

FTC = Path(sys.executable).parent / "ftc"


@pytest.fixture(scope="module")
def header(engine_dir) -> ftw.FtwHeader:
    return ftw.read_header(engine_dir / "experts.ftw")[0]


def smallest_shard(engine_dir: Path, header: ftw.FtwHeader) -> int:
    """The least shard size that holds an expert with the header and one with the trailer."""
    trailer = (engine_dir / "experts.ftw").stat().st_size - header.trailer_offset
    return header.expert_stride + max(header.data_offset, trailer)


@pytest.fixture(scope="module")
def packaged(engine_dir, header, tmp_path_factory) -> Path:
    """The tiny engine packaged into several shards (a size drawn per module run)."""
    rng = random.Random(seed_for("packaged"))
    size = smallest_shard(engine_dir, header) + rng.randrange(4 * header.expert_stride)
    return package_engine(engine_dir, tmp_path_factory.mktemp("pkg") / "tiny-pkg", shard_size=size)


def logits(engine: Path, prompt: list[int]) -> torch.Tensor:
    return Engine.load(engine).logits(prompt)


def test_shards_hold_the_expert_file_cut_at_expert_boundaries(engine_dir, header, packaged):
    m = EngineManifest.read(packaged)
    shards = m.expert_files
    limit = json.loads((packaged / "engine.json").read_text())["package"]["shard_size"]
    assert len(shards) >= 2, "the test packages into several shards"
    data = b"".join((packaged / s).read_bytes() for s in shards)
    assert data == (engine_dir / "experts.ftw").read_bytes()
    start = 0
    for s in shards:
        n = (packaged / s).stat().st_size
        assert n <= limit, f"{s}: {n} bytes above the shard size {limit}"
        if start:  # each later shard starts with a whole expert: O_DIRECT reads it from its first byte
            assert (start - header.data_offset) % header.expert_stride == 0 and start % 4096 == 0
        start += n
    assert (packaged / "README.md").read_text().count("ftc run") >= 2 and "README.md" in m.files  # hashed, archived


def test_shard_cuts_respect_the_size_and_the_expert_boundaries(header, engine_dir, seed):
    rng = random.Random(seed)
    total = (engine_dir / "experts.ftw").stat().st_size
    least = smallest_shard(engine_dir, header)
    for _ in range(50):
        size = rng.randrange(least, total + 10 * header.expert_stride)
        cuts = shard_cuts(header, total, size)
        ends = [*cuts[1:], total]
        assert all(b - a <= size for a, b in zip(cuts, ends, strict=True)), (size, cuts)
        assert all((c - header.data_offset) % header.expert_stride == 0 for c in cuts[1:]), (size, cuts)
        assert cuts[-1] < header.trailer_offset and (len(cuts) == 1 or cuts[1] > header.data_offset)
        assert len(cuts) == 1 or sum(ends[i] - cuts[i] for i in (-1, -2)) > size  # no needless shard
    with pytest.raises(ArtifactError, match="too small for one expert"):
        shard_cuts(header, total, least - 1)


def test_the_package_gives_the_engines_logits(engine_dir, packaged, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(EngineManifest.read(engine_dir).spec.vocab_size) for _ in range(rng.randrange(3, 12))]
    assert torch.equal(logits(packaged, prompt), logits(engine_dir, prompt))
    check_engine(packaged, hash_experts=True)  # every shard's sha256 as recorded


def test_an_archive_unpacks_once_and_gives_the_engines_logits(engine_dir, header, tmp_path, seed):
    rng = random.Random(seed)
    size = smallest_shard(engine_dir, header) + rng.randrange(4 * header.expert_stride)
    tar = package_engine(engine_dir, tmp_path / "tiny.tar", shard_size=size, archive=True)
    folder = resolve_engine(tar)
    assert resolve_engine(tar) == folder  # unpacked once, keyed by its engine.json
    prompt = [rng.randrange(EngineManifest.read(engine_dir).spec.vocab_size) for _ in range(5)]
    assert torch.equal(logits(folder, prompt), logits(engine_dir, prompt))


def copy_of(packaged: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pkg"
    shutil.copytree(packaged, copy)
    return copy


def test_a_tampered_shard_is_refused_with_its_name(packaged, header, tmp_path, seed):
    rng = random.Random(seed)
    copy = copy_of(packaged, tmp_path)
    shard = rng.choice(EngineManifest.read(copy).expert_files[1:])
    data = bytearray((copy / shard).read_bytes())
    at = rng.randrange(header.expert_stride)  # inside its first expert (its first bank's row)
    at = at % header.banks[0].row_bytes
    data[at] ^= 1 << rng.randrange(8)
    (copy / shard).write_bytes(bytes(data))
    with pytest.raises(ftw.FtwError, match=rf"{shard}: corrupted: bank"):
        Engine.load(copy)
    with pytest.raises((ftw.FtwError, ArtifactError), match=rf"{shard}: corrupted"):
        check_engine(copy, hash_experts=True)


def test_a_missing_or_truncated_shard_is_refused_with_its_name(packaged, tmp_path, seed):
    rng = random.Random(seed)
    copy = copy_of(packaged, tmp_path)
    shard = rng.choice(EngineManifest.read(copy).expert_files)
    data = (copy / shard).read_bytes()
    (copy / shard).write_bytes(data[:rng.randrange(len(data))])
    with pytest.raises(ArtifactError, match=rf"{shard}: truncated"):
        Engine.load(copy)
    (copy / shard).unlink()
    with pytest.raises(ArtifactError, match=rf"{shard}: missing from the engine"):
        Engine.load(copy)


def test_a_wrong_hash_is_refused_with_the_file_named(packaged, tmp_path, seed):
    rng = random.Random(seed)
    copy = copy_of(packaged, tmp_path)
    raw = json.loads((copy / "engine.json").read_text())
    shard = rng.choice(raw["experts_shards"])
    raw["files"][shard]["sha256"] = f"{rng.randrange(16**64):064x}"
    (copy / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=rf"{shard}: corrupted: sha256 differs"):
        check_engine(copy, hash_experts=True)
    raw["files"]["dense.safetensors"]["sha256"] = f"{rng.randrange(16**64):064x}"
    (copy / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"dense\.safetensors: corrupted: sha256 differs"):
        Engine.load(copy)


def test_shards_out_of_order_or_unlisted_are_refused(packaged, tmp_path):
    copy = copy_of(packaged, tmp_path)
    raw = json.loads((copy / "engine.json").read_text())
    shards = raw["experts_shards"]
    raw["experts_shards"] = [shards[1], shards[0], *shards[2:]]
    (copy / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(ftw.FtwError, match=rf"{shards[0]}|{shards[1]}"):
        Engine.load(copy)
    raw["experts_shards"] = [*shards, "experts-99999-of-99999.ftw"]
    (copy / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"experts_shards.*has no entry in 'files'"):
        Engine.load(copy)


def test_a_hub_repository_id_runs_the_package_from_the_hub_cache(engine_dir, packaged, tmp_path, seed):
    """`ftc run ORG/NAME`: the package as a repository's snapshot in a folder laid out as the Hub
    cache, the Hub offline; the same tokens as the engine it came from."""
    rng = random.Random(seed)
    repo, commit = f"test-org/tiny-{rng.randrange(10**6)}", f"{rng.randrange(16**40):040x}"
    folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    shutil.copytree(packaged, folder / "snapshots" / commit)
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    vocab = EngineManifest.read(engine_dir).spec.vocab_size
    ids = ",".join(str(rng.randrange(vocab)) for _ in range(4))

    def tokens(engine: str) -> list[int]:
        r = subprocess.run([str(FTC), "run", engine, "--prompt-ids", ids, "--max-new-tokens", "6", "--ignore-eos",
                            "--json"], capture_output=True, text=True, env=env, timeout=300, input="")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["tokens"]

    assert tokens(repo) == tokens(str(engine_dir))
    r = subprocess.run([str(FTC), "run", "test-org/absent", "--prompt-ids", ids], capture_output=True, text=True,
                       env=env, timeout=300, input="")
    assert r.returncode == 1 and r.stderr.startswith("error: test-org/absent: not in the Hugging Face cache"), r.stderr


def test_a_package_for_another_isa_is_refused_with_what_it_needs(packaged, tmp_path, seed):
    """A manifest that claims another CPU ISA than its library's (a package from another machine):
    refused before any weight is read, naming the library and what is missing or mismatched."""
    from ftc_runtime.cpu_info import ISA_FLAGS
    from ftc_runtime.experts.cpu_kernel import KernelError

    copy = copy_of(packaged, tmp_path)
    raw = json.loads((copy / "engine.json").read_text())
    raw["plan"]["isa"] = random.Random(seed).choice([isa for isa in ISA_FLAGS if isa != raw["plan"]["isa"]])
    (copy / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(KernelError, match=r"libftc_kernels\.so: (built for .*, but this CPU lacks|library was built "
                                          r"for \(isa, hidden, intermediate\))"):
        Engine.load(copy)


def test_a_cpu_without_the_engines_isa_builds_the_packages_other_kernels(packaged, monkeypatch, capfd, seed):
    """The tiny engine's AVX2 library on a CPU made to lack AVX2: the package's AVX-512 BF16 sources
    are built (once: the second load takes the cache) and the engine runs on them, within the
    kernels' rounding of the AVX2 engine. Needs a CPU with AVX-512 BF16 (else skipped)."""
    from ftc_runtime import cpu_info

    m = EngineManifest.read(packaged)
    assert m.plan.isa == "avx2" and "avx512_bf16" in m.raw["package"]["kernel_sets"]
    if cpu_info.missing_flags("avx512_bf16"):
        pytest.skip("this CPU lacks AVX-512 BF16: no other ISA's kernels could run here")
    rng = random.Random(seed)
    prompt = [rng.randrange(m.spec.vocab_size) for _ in range(rng.randrange(3, 10))]
    want = logits(packaged, prompt)
    flags = cpu_info.cpu_flags() - {"avx2"}
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: flags)
    got = logits(packaged, prompt)
    assert "which this CPU lacks (avx2): running the package's avx512_bf16 kernels" in capfd.readouterr().err
    # bf16 activations against fp32, through a tiny random model's near-tied router (4.2e-2 once):
    # a wrong kernel set would be off by the logits' own size
    assert float((got - want).norm() / want.norm()) < 8e-2
    assert near_best_share(got, want) >= 0.95
    logits(packaged, prompt)
    assert "avx512_bf16 kernels, taken from" in capfd.readouterr().err


def test_a_package_or_a_taken_output_is_refused(packaged, engine_dir, tmp_path):
    with pytest.raises(ArtifactError, match="already a package"):
        package_engine(packaged, tmp_path / "again")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ArtifactError, match="taken: already exists"):
        package_engine(engine_dir, tmp_path / "taken")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging folder left behind
