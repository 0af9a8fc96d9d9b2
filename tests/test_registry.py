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
    """pyproject.toml finds the packages a (non-editable) install carries, in each package's folder
    (the compiler at the top, runtime/ftc_runtime/, templates/ftc_templates/), and lists none by
    hand: a family's folder added later is found, where a list would leave it out of every wheel."""
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    from setuptools.config.pyprojecttoml import read_configuration

    root = Path(__file__).resolve().parents[1]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert isinstance(packages, dict) and "find" in packages, f"pyproject.toml lists packages by hand: {packages}"
    found = set(read_configuration(root / "pyproject.toml")["tool"]["setuptools"]["packages"])
    folders = {"ftc": root, "ftc_runtime": root / "runtime", "ftc_templates": root / "templates"}
    on_disk = {".".join(p.parent.relative_to(base).parts) for top, base in folders.items()
               for p in (base / top).rglob("__init__.py")}
    assert on_disk - found == set(), "package folders pyproject.toml does not find"
