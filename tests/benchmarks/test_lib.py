"""The shared benchmark helpers (benchmarks/_lib.py) and the rule that scripts share code
only through the underscore modules."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_lib():
    spec = importlib.util.spec_from_file_location("_lib", BENCHMARKS / "_lib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lib = _load_lib()


def write_log(run: Path, events: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


EVENTS = [
    {"event": "train", "step": 1, "elapsed_s": 6.0, "tokens_per_s": 10.0},
    {"event": "train", "step": 200, "elapsed_s": 60.0, "tokens_per_s": 30.0},
    {"event": "valid", "step": 200, "loss": 2.123456, "bleu": 12.345},
    {"event": "train", "step": 300, "elapsed_s": 120.0, "tokens_per_s": 20.0},
    {"event": "valid", "step": 300, "loss": 2.0},
    {"event": "stop", "step": 300, "elapsed_s": 126.0, "reason": "max_steps"},
]


def test_log_readers(tmp_path):
    run = tmp_path / "run"
    write_log(run, EVENTS)
    curve = lib.learning_curve(run)
    assert curve[0] == {"step": 200, "minutes": 1.0, "valid_bleu": 12.35, "valid_loss": 2.1235}
    assert curve[1]["minutes"] == 2.0 and curve[1]["valid_bleu"] != curve[1]["valid_bleu"]  # nan
    assert list(lib.valid_curve(run)) == [200, 300]
    assert list(lib.valid_curve(run, every=200)) == [200]
    assert lib.throughput(run) == {"train_minutes": 2.1, "steps": 300, "tgt_tokens_per_s": 30.0}
    assert lib.finished(run, 300) and not lib.finished(run, 301)


def test_missing_log(tmp_path):
    with pytest.raises(FileNotFoundError):
        lib.read_log(tmp_path)
    assert lib.read_log(tmp_path, missing_ok=True) == []
    assert lib.valid_curve(tmp_path, missing_ok=True) == {}
    assert not lib.finished(tmp_path)
    with pytest.raises(ValueError):
        lib.valid_curve(tmp_path, every=0)


def test_markdown_helpers():
    assert lib.md_table(["a", "b"], "lr", [[1, ""], ["x", 2.5]]) == [
        "| a | b |", "|---|---:|", "| 1 |  |", "| x | 2.5 |"]
    with pytest.raises(ValueError):
        lib.md_table(["a", "b"], "l", [])
    with pytest.raises(ValueError):
        lib.md_table(["a"], "l", [[1, 2]])
    assert lib.md_head("t", "cmd", "Machine: m", "last") == [
        "# t", "", "Command: `cmd`  ", "Machine: m  ", "last", ""]


def test_command_quotes_arguments():
    assert lib.command(["benchmarks/x.py", "--a", "b c"]) == "python benchmarks/x.py --a 'b c'"
    with pytest.raises(ValueError):
        lib.command([])


def test_write_results_and_committed_rows(tmp_path):
    data = {"date": "2026-01-02", "rows": [{"name": "a"}, {"name": "b", "measured": "x"}]}
    lib.write_results(tmp_path, "r", data, ["# r", "", "text"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # no temp files
    assert (tmp_path / "r.json").read_text() == json.dumps(data, indent=1)
    assert (tmp_path / "r.md").read_text() == "# r\n\ntext\n"
    rows = lib.committed_rows(tmp_path / "r.json", "name", "date")
    assert rows["a"]["measured"] == "2026-01-02" and rows["b"]["measured"] == "x"
    assert "measured" not in lib.committed_rows(tmp_path / "r.json", "name")["a"]
    assert lib.committed_rows(tmp_path / "none.json", "name") == {}
    with pytest.raises(ValueError):
        lib.write_results(tmp_path, "a/b", data)


@pytest.mark.parametrize("path", sorted((BENCHMARKS / "variants").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_registries_load(path):
    data = lib.variants_file(path.stem)
    assert data and all(isinstance(k, str) for k in data)


def test_registry_rejects_missing_fields():
    with pytest.raises(ValueError, match="lacks"):
        lib.registry("dmb", "variants", ("lane", "no_such_field"))
    with pytest.raises(ValueError, match="no section"):
        lib.registry("dmb", "no_such_section")


def test_scripts_import_only_shared_modules():
    """No benchmark script imports another; shared code lives in _lib / _plot."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            for name in names:
                top = name.split(".")[0]
                assert top not in scripts or top.startswith("_"), f"{path.name} imports {name}"



def test_provenance_records_command_commit_whole_tree_dirty_flag_and_date(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "src.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git[:3], "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    where = repo / "benchmarks"
    assert lib.code_state(where) == {"commit": head, "dirty": False}
    (repo / "benchmarks" / "new.py").write_text("")  # an untracked file under benchmarks/
    assert lib.code_state(where) == {"commit": head, "dirty": True}
    (repo / "benchmarks" / "new.py").unlink()
    (repo / "src.py").write_text("x = 2\n")  # a change outside benchmarks/
    assert lib.code_state(where)["dirty"] is True
    assert lib.code_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    made = lib.provenance(["benchmarks/x.py", "report", "--only", "a b"], where)
    assert made["command"] == "python benchmarks/x.py report --only 'a b'"
    assert (made["commit"], made["dirty"]) == (head, True)
    assert len(made["date"]) == len("2026-11-25 13:45") and made["date"][4] == "-"


def test_made_by_lines_name_each_rows_command_commit_and_date():
    a = {"command": "python benchmarks/x.py report --only p", "commit": "0123456789abcdef",
         "dirty": False, "date": "2026-11-25 10:00"}
    b = {**a, "command": "python benchmarks/x.py report --only q r", "dirty": True}
    rows = [{"name": "p"}, {"name": "q"}, {"name": "r"}, {"name": "old"}]
    lib.stamp(rows[:1], a)
    lib.stamp(rows[1:3], b)
    assert lib.made_by_lines(rows, "name") == [
        "## How each row was made", "",
        "- p: `python benchmarks/x.py report --only p` (commit 0123456789ab, 2026-11-25 10:00 "
        "UTC)",
        "- q, r: `python benchmarks/x.py report --only q r` (commit 0123456789ab with "
        "uncommitted changes, 2026-11-25 10:00 UTC)",
        "- old: made before result rows recorded their command and commit."]


def _commit(repo: Path, files: dict[str, str], when: int) -> str:
    """Write ``files`` in git repository ``repo`` and commit them at UTC time ``when``."""
    import subprocess

    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    env = {"GIT_AUTHOR_DATE": f"{when} +0000", "GIT_COMMITTER_DATE": f"{when} +0000",
           "PATH": "/usr/bin:/bin"}
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "."], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "c"], check=True, env=env)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_made_by_from_git_finds_the_commit_each_row_reached_its_value(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "-C", str(repo), "init", "-q"], check=True)
    old_script = 'sub.add_parser("train")\nt.add_argument("--only")\nsub.add_parser("report")\n'
    new_script = old_script + 'r.add_argument("--only")\n'

    def results(rows, script=new_script):
        return {"benchmarks/x.py": script,
                "benchmarks/results/x.json": json.dumps({"rows": rows}, indent=1)}

    one = _commit(repo, results([{"name": "a", "v": 1},
                                 {"name": "b", "v": 1, "ms": 9.0, "measured": "2023-11-13"},
                                 {"name": "gone", "v": 0}], old_script), 1_700_000_000)
    # a re-measured; b carried over: its latency dropped and its date rewritten, values kept
    two = _commit(repo, results([{"name": "a", "v": 2}, {"name": "b", "v": 1,
                                                        "measured": "2023-11-14"}]),
                  1_700_003_600)
    stamped = {"command": "python benchmarks/x.py report --only c", "commit": two,
               "dirty": False, "date": "2023-11-15 00:00"}
    three = _commit(repo, results([{"name": "a", "v": 2}, {"name": "b", "v": 1,
                                                          "measured": "2023-11-14"},
                                   {"name": "c", "v": 3, "made_by": stamped}]),
                    1_700_090_000)
    path = repo / "benchmarks/results/x.json"
    out = lib.made_by_from_git(path, "name", "benchmarks/x.py",
                               lambda r: ["report", "--only", r["name"]])
    a, b, c = out["rows"]
    assert a["made_by"] == {"command": "python benchmarks/x.py report --only a", "commit": two,
                            "dirty": None, "date": "2023-11-14 23:13", "reconstructed": "git"}
    # b has not changed since commit one, whose report had no --only
    assert b["made_by"] == {"command": "python benchmarks/x.py report", "commit": one,
                            "dirty": None, "date": "2023-11-14 22:13", "reconstructed": "git"}
    assert c["made_by"] == stamped and three != two
    assert {k: v for k, v in a.items() if k != "made_by"} == {"name": "a", "v": 2}
    assert json.loads(path.read_text())["rows"][0] == {"name": "a", "v": 2}  # not written
    assert lib.made_by_lines(out["rows"], "name")[2] == (
        "- a: `python benchmarks/x.py report --only a` (reconstructed from git history: the "
        f"row as it is now was first committed in commit {two[:12]}, 2023-11-14 23:13 UTC; "
        "the state of the tree it ran in is not known)")
    # a row changed since the last commit has no history to reconstruct: measure it again
    path.write_text(json.dumps({"rows": [{"name": "a", "v": 5}]}))
    with pytest.raises(ValueError, match="row 'a' differs from the file's last commit"):
        lib.made_by_from_git(path, "name", "benchmarks/x.py", lambda r: ["report"])


@pytest.mark.parametrize("stem,key,script", [("cct_quality", "system", "cct_quality"),
                                             ("cct_adherence", "system", "cct_quality"),
                                             ("dmb", "name", "dmb"),
                                             ("micronet", "name", "micronet")])
def test_every_committed_row_records_what_made_it(stem, key, script):
    rows = json.loads((BENCHMARKS / "results" / f"{stem}.json").read_text())["rows"]
    missing = [r[key] for r in rows if not r.get("made_by")]
    assert not missing, f"{stem}.json rows without made_by: {missing}"
    for r in rows:
        m = r["made_by"]
        assert m["command"].startswith(f"python benchmarks/{script}.py report"), m
        assert len(m["commit"]) == 40 and len(m["date"]) == len("2026-11-25 13:45"), m
    md = (BENCHMARKS / "results" / f"{stem}.md").read_text()
    assert "made before result rows recorded" not in md


def test_paired_diff_ci():
    from sklearn.metrics import accuracy_score

    gold = ["pos", "neg"] * 100
    wrong = {"pos": "neg", "neg": "pos"}
    b = [wrong[g] if i % 10 == 0 else g for i, g in enumerate(gold)]  # 90% right
    assert lib.paired_diff_ci(accuracy_score, gold, b, b, n_resamples=200) == (0.0, 0.0)
    lo, hi = lib.paired_diff_ci(accuracy_score, gold, gold, b, n_resamples=200)
    assert 0.0 < lo < 0.1 < hi < 0.2  # the right answers' +0.10, and more than noise
    lo2, hi2 = lib.paired_diff_ci(accuracy_score, gold, b, gold, n_resamples=200)
    assert (lo2, hi2) == pytest.approx((-hi, -lo))


def test_done_holds_a_run_to_the_limits_asked_now(tmp_path):
    from types import SimpleNamespace

    def cfg(steps, minutes=None):
        return SimpleNamespace(train=SimpleNamespace(max_steps=steps, max_minutes=minutes))

    run = tmp_path / "run"
    write_log(run, EVENTS)  # stopped at its update limit: 300 updates, 126 s
    assert lib.done(run) and lib.done(run, cfg(300)) and lib.done(run, cfg(200))
    assert not lib.done(run, cfg(600))  # a longer schedule: resume, not done
    timed = tmp_path / "timed"
    write_log(timed, [*EVENTS[:-1],
                      {"event": "stop", "step": 300, "elapsed_s": 126.0, "reason": "max_minutes"}])
    assert lib.done(timed, cfg(1000, 2.0)) and not lib.done(timed, cfg(1000, 3.0))
    assert not lib.done(timed, cfg(1000))  # no time limit now: it trains on to 1000 updates
    signalled = tmp_path / "signalled"
    write_log(signalled, [*EVENTS[:-1], {"event": "stop", "step": 300, "reason": "signal"}])
    assert not lib.done(signalled) and not lib.done(signalled, cfg(300))
    assert not lib.done(tmp_path / "none", cfg(1))


def test_train_each_ends_the_script_after_a_signal(monkeypatch, capsys):
    from types import SimpleNamespace

    import dynaseq.train.loop

    trained = []

    def fake_train(cfg, progress):
        trained.append(cfg.run_dir)
        return SimpleNamespace(stopped_by_signal=15 if cfg.run_dir == "b" else None)

    monkeypatch.setattr(dynaseq.train.loop, "train", fake_train)
    with pytest.raises(SystemExit) as e:
        lib.train_each(SimpleNamespace(run_dir=r) for r in "abc")
    assert e.value.code == 130 and trained == ["a", "b"]
    assert "stopped by a signal in b" in capsys.readouterr().err


def test_train_in_processes_writes_each_config_and_trains_it_with_the_cli(tmp_path,
                                                                        monkeypatch):
    """Each run config becomes ``{out}/{run name}.yaml`` (what ``dynaseq train`` reads back
    to the same config) and one ``dynaseq train`` process, through :func:`run_parallel`."""
    from dynaseq.tasks.registry import load_config

    jobs = {}
    monkeypatch.setattr(lib, "run_parallel", lambda j, n, out: jobs.update(j, n=n, out=out))
    configs = [load_config("configs/wikitext2_mlm_small.yaml",
                           [f"run_dir={tmp_path}/runs/{name}", "train.max_steps=7"])
               for name in ("a_mlm", "b_mlm")]
    lib.train_in_processes(configs, 2, tmp_path / "procs")
    assert jobs.pop("n") == 2 and jobs.pop("out") == tmp_path / "procs"
    assert list(jobs) == ["a_mlm", "b_mlm"]
    path = tmp_path / "procs" / "b_mlm.yaml"
    assert jobs["b_mlm"][1:] == ["-m", "dynaseq", "train", str(path), "--quiet"]
    assert load_config(path, []) == configs[1]
