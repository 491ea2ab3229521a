"""The built wheel holds every module on disk (an editable install hides a missing one)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"actors": "trio_llm/actors", "gpu": "trio_llm/gpu", "api": "trio_llm/api"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
    )
    (wheel,) = out.glob("trio_llm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.mark.parametrize("folder", sorted(SUBPACKAGES))
def test_every_module_on_disk_is_in_the_wheel(folder: str, wheel_names: set[str]) -> None:
    on_disk = {
        f"{SUBPACKAGES[folder]}/{path.relative_to(ROOT / folder).as_posix()}"
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert on_disk, f"no modules found in {folder}/"
    missing = on_disk - wheel_names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"


def test_wheel_has_type_markers_and_entry_point(wheel_names: set[str]) -> None:
    for target in SUBPACKAGES.values():
        assert f"{target}/py.typed" in wheel_names
    entry_points = [name for name in wheel_names if name.endswith("entry_points.txt")]
    assert entry_points, "the wheel declares no console script"
