"""The README and docs/: what they say runs, and their numbers are current."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_flashoverlap import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_is_short_and_for_users():
    assert len(README.splitlines()) <= 250
    assert " -P " not in README and "DESIGN.md" not in README
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / link).exists(), link


def test_readme_lists_every_setting():
    for name in settings.SETTINGS:
        assert f"`{name}`" in README, name


@pytest.mark.parametrize("block", range(len(PYTHON_BLOCKS)))
def test_readme_code_runs_as_written(block, tmp_path):
    """Each python block, alone, in a fresh interpreter outside the checkout."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[block]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_quickstart_prints_what_its_comments_say(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[0]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600).stdout.splitlines()
    shape, err = out[0].rsplit(" ", 1)
    assert shape == "(64, 2, 128)" and float(err) < 1e-4
    assert out[1] == "(64, 2, 512) float32[64,2@data,512@tensor]"


def test_results_docs_are_generated_from_the_results():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "make_results.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_the_decode_table_names_the_commit_of_every_run():
    """Rows gathered from several runs (meta.runs) each say which commit ran them."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "decode_1xh200.json").read_text())
    results = (ROOT / "docs" / "results.md").read_text()
    section = results[results.index("## Decoding"):results.index("### The one-kernel decode step")]
    source = (doc["meta"]["commit"][:7], str(doc["meta"]["date"])[:10])
    for run in doc["meta"]["runs"]:
        commit, date = run["commit"][:7], str(run["date"])[:10]
        if (commit, date) == source:
            continue  # the table's source line names it
        named = f"At {commit}, {date}: "
        assert named in section, run
        sentence = section[section.index(named):].split(".")[0]
        assert all(f"{row}," in sentence + "," for row in run["rows"]), run


def test_the_package_imports_whole_from_the_checkout_root(tmp_path):
    """Run from the checkout's root, the source folder is found first; the
    extension and the models must still come from the install."""
    code = ("import jax_flashoverlap as j, jax_flashoverlap.models as m; "
            "print(j.build_info()['extension'], m.Transformer.__name__)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=300) for cwd in (ROOT, tmp_path)]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout == "True Transformer\n"
