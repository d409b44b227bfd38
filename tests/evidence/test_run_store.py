"""gear.evidence's run store: a finished run is read back, a stopped grid resumes where it
stopped, a write is atomic (a temporary is never a run), and the key follows the code; and the
statistics added beside it (seeds needed for a power, Bonferroni levels)."""

from __future__ import annotations

import json
import os

import pytest

from gear.evidence import (
    RecordStore,
    RunStore,
    bonferroni,
    code_digest,
    mde,
    n_for_power,
    power_at,
    replacing,
    run_key,
    write_json,
)


def train_v1(seed: int) -> int:
    return seed + 1


def train_v2(seed: int) -> int:  # a different source: another version of the training code
    return seed + 2


def test_a_kept_run_is_read_back_and_a_stopped_grid_resumes(tmp_path):
    store = RunStore(tmp_path, code_digest([train_v1]))
    grid = [{"arm": arm, "seed": s} for s in (0, 1) for arm in ("grpo", "gear")]
    trained = []

    def run(params, stop_after=None):
        out = []
        for p in params:
            if (kept := store.get(p)) is not None:
                out.append(kept)
                continue
            if stop_after is not None and len(trained) >= stop_after:
                raise KeyboardInterrupt  # the grid is stopped mid-way
            trained.append(p)
            out.append(store.put(p, {"final": train_v1(p["seed"]), **p}))
        return out

    with pytest.raises(KeyboardInterrupt):
        run(grid, stop_after=3)
    assert store.status(grid) == {"kept": 3, "missing": [grid[3]], "of": 4}
    results = run(grid)  # resumes: only the missing run trains
    assert trained == grid  # each run trained once
    assert [r["final"] for r in results] == [1, 1, 2, 2]
    assert run(grid) == results and len(trained) == 4  # all read back now
    assert store.status(grid)["kept"] == 4 and len(store.kept()) == 4


def test_a_write_is_atomic_and_a_temporary_is_never_a_run(tmp_path):
    store = RunStore(tmp_path, "c")
    p = {"arm": "grpo", "seed": 0}
    # a run killed while writing leaves only its temporary: not kept, not read
    store.path(p).with_suffix(".1234.tmp").write_text('{"half": ')
    assert store.get(p) is None and store.kept() == [] and store.status([p])["kept"] == 0
    store.put(p, {"final": 0.5})
    assert store.get(p) == {"final": 0.5} and store.kept() == [store.key(p)]
    assert not list(tmp_path.glob(f"*.{os.getpid()}.tmp"))  # renamed, not left
    # a result of another kind beside the runs is kept under its prefix, not counted as a run
    store.put({"seed": 0}, {"step0": 1.0}, prefix="base-")
    assert store.kept() == [store.key(p)] and store.kept("base-") == [store.key({"seed": 0})]
    assert json.loads(write_json(tmp_path / "sub" / "x.json", [1, 2]).read_text()) == [1, 2]


def test_a_block_that_fails_leaves_the_kept_file_as_it_was(tmp_path):
    path = tmp_path / "x.pt"
    path.write_text("kept")
    with pytest.raises(ValueError), replacing(path) as tmp:
        tmp.write_text("half")
        raise ValueError("killed while writing")
    assert path.read_text() == "kept"
    with replacing(path) as tmp:  # a writer that needs a path (torch.save)
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and not tmp.exists()


def test_a_named_record_is_kept_with_the_bytes_the_studies_committed(tmp_path):
    store = RecordStore(tmp_path / "runs")
    assert store.get("gate-seed0") is None and store.all() == []
    record = {"name": "gate-seed0", "after": {"mean_reward": 0.5}, "reward": [0.1, 0.2]}
    assert store.put("gate-seed0", record) is record
    # the studies' committed records are json.dumps(indent=1), no trailing newline
    assert store.path("gate-seed0").read_text() == json.dumps(record, indent=1)
    store.put("main-seed1", {"name": "main-seed1"})
    store.path("gate-seed1").with_suffix(".json.99.tmp").write_text('{"half": ')
    assert store.get("gate-seed0") == record
    assert store.names() == ["gate-seed0", "main-seed1"]
    assert [r["name"] for r in store.all()] == ["gate-seed0", "main-seed1"]
    assert store.all("gate-*") == [record]


def test_the_key_follows_the_code_and_every_parameter(tmp_path):
    p = {"arm": "grpo", "seed": 0, "cfg": {"lr": 1e-5, "steps": 12}}
    v1, v2 = code_digest([train_v1]), code_digest([train_v2])
    assert v1 != v2 and code_digest([train_v1]) == v1
    assert run_key(p, v1) != run_key(p, v2)  # an edit of the training code reruns
    assert run_key(p, v1) == run_key(dict(reversed(p.items())), v1)  # order does not matter
    for changed in ({"seed": 1}, {"arm": "gear"}, {"cfg": {"lr": 2e-5, "steps": 12}}):
        assert run_key({**p, **changed}, v1) != run_key(p, v1)
    # a run kept under the old code is not read under the new one
    RunStore(tmp_path, v1).put(p, {"final": 1})
    assert RunStore(tmp_path, v2).get(p) is None and RunStore(tmp_path, v1).get(p) == {"final": 1}
    # files count byte for byte, and a missing one is an error, never silently skipped
    f = tmp_path / "module.py"
    f.write_text("x = 1\n")
    before = code_digest([train_v1], [f])
    f.write_text("x = 2\n")
    assert code_digest([train_v1], [f]) != before
    with pytest.raises(FileNotFoundError):
        code_digest(files=[tmp_path / "absent.py"])
    with pytest.raises(ValueError, match="code"):
        run_key({"code": 1}, v1)


def test_the_seeds_needed_are_the_first_n_with_the_power():
    n = n_for_power(0.5, 1.0)
    assert power_at(0.5, 1.0, n) >= 0.8 > power_at(0.5, 1.0, n - 1)
    assert n_for_power(-0.5, 1.0) == n  # the size of the effect, either sign
    assert n_for_power(mde(1.0, 12) * 1.001, 1.0) == 12
    assert n_for_power(0.0, 1.0) is None  # no effect: power stays at alpha
    assert n_for_power(0.01, 1.0, stop=50) is None


def test_bonferroni_divides_alpha_over_the_comparisons():
    assert bonferroni(1) == 0.95 and bonferroni(3) == 1 - 0.05 / 3
    assert bonferroni(2, alpha=0.1) == pytest.approx(0.95)
    with pytest.raises(ValueError, match="at least 1"):
        bonferroni(0)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from gear.evidence import replacing, write_text

    path = write_text(tmp_path / "r.json", "old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
