"""The example notebooks hold exactly their script twins' cells; the scripts run top to bottom on the
embedded default models (slow)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import has_embedded_models

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
nbformat = pytest.importorskip("nbformat")
from make_notebooks import SCRIPTS, cells  # noqa: E402


@pytest.mark.parametrize("name", SCRIPTS)
def test_notebook_matches_its_script(name):
    script = (EXAMPLES / name).read_text()
    nb = nbformat.read(EXAMPLES / name.replace(".py", ".ipynb"), as_version=4)
    assert [(c.cell_type, c.source) for c in nb.cells] == cells(script)
    assert sum(kind == "code" for kind, _ in cells(script)) >= 3


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_top_to_bottom(name, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    if name == "tune_ratio.py":
        assert (tmp_path / "tune_ratio.png").read_bytes()[:4] == b"\x89PNG"
