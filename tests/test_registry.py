"""Every registered model family has its tiny test models (tests/families.py), and every entry
there is a registered family: a family cannot be added without the parity tests running on it,
nor a test entry outlive its family (vLLM's rule for its model registry)."""

from __future__ import annotations

from ftc_runtime.models import FAMILIES, family

from families import TINY_FAMILIES


def test_every_registered_family_has_a_test_family_and_no_other_exists():
    registered, tested = set(FAMILIES), set(TINY_FAMILIES)
    assert registered - tested == set(), "registered without an entry in tests/families.py"
    assert tested - registered == set(), "entries in tests/families.py without a registered family"


def test_each_test_family_is_complete():
    for name, tiny in TINY_FAMILIES.items():
        assert tiny.name == name and family(name).name == name
        assert tiny.checkpoints and tiny.targets, name
        assert len({c.id for c in tiny.checkpoints}) == len(tiny.checkpoints), f"{name}: checkpoint ids repeat"
        # 'cpu' compiles the AVX2 kernel; 'auto' may pick AVX-512 BF16 on a CPU that has it
        isas = {"avx2"} | ({"avx512_bf16"} if "auto" in tiny.targets else set())
        assert isas <= set(tiny.bounds), f"{name}: no bounds for {isas - set(tiny.bounds)}"


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages a (non-editable) install carries: a family's folder left
    out would be missing from every wheel, though an editable install finds it."""
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    names = {"runtime": "ftc_runtime", "ftc": "ftc"}
    found = {".".join([names[p.parts[0]], *p.parts[1:]]) for top in names
             for p in (f.parent.relative_to(root) for f in (root / top).rglob("__init__.py"))}
    assert found - listed == set(), "package folders pyproject.toml does not install"
