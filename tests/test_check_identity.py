"""bench/check_identity.py: the refactor's before/after check flags a changed answer and a KL gap over the
tolerance, and nothing else."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("check_identity", Path(__file__).parents[1] / "bench" / "check_identity.py")
check_identity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_identity)


def write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    (folder / "records.jsonl").write_text(json.dumps(rows) + "\n")
    return folder


def row(variant: str, output: str, tf_kl: float, seed: int = 0) -> dict:
    return {"task": "single1", "length": 1024, "seed": seed, "variant": variant, "ratio": 0.2, "output": output,
            "tf_kl": tf_kl}


def test_identical_runs_pass_and_a_changed_answer_or_kl_fails(tmp_path):
    before = [row("full", "42", 0.0), row("cacheclip", "42", 0.1), row("cacheclip", "7", 0.2, seed=1)]
    same = check_identity.compare(check_identity.records(write(tmp_path / "a", before)),
                                  check_identity.records(write(tmp_path / "b", before)), 1e-6)
    assert same["differing"] == [] and same["rows"] == 3 and same["cases"] == 2 and same["identical_answers"] == 3
    after = [row("full", "42", 0.0), row("cacheclip", "43", 0.1), row("cacheclip", "7", 0.2 + 2e-6, seed=1)]
    changed = check_identity.compare(check_identity.records(tmp_path / "a"),
                                     check_identity.records(write(tmp_path / "c", after)), 1e-6)
    assert [d["case"]["seed"] for d in changed["differing"]] == [0, 1]
    assert changed["identical_answers"] == 2 and abs(changed["max_tf_kl_gap"] - 2e-6) < 1e-9
