"""`attnres-pp bench`'s registry and harness: every benchmark is a subcommand whose module provides
the harness's contract, its own flags exist only on its own parser, and a moved benchmark (quality)
writes its files through the one results writer under its old names, with the `attnres-pp bench`
command that ran it. The measurement lab (`attnres-lab`) runs its studies through the same harness.
No benchmark runs here: `run` is replaced by a stand-in."""

from __future__ import annotations

import datetime
import json

import pytest

from attnres_pp.bench import quality
from attnres_pp.bench.cli import REGISTRY, module_of
from attnres_pp.cli import build_parser, main

OWN_FLAGS = {"--no-timing": {"comm"}, "--compile": {"variants"},
             "--only": {"quality"}, "--eval-bytes": {"quality-depth"}, "--no-full": {"quality-depth"},
             "--dry-run-cpu": {"kernels", "kernel-streams"}}


def _parsers():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices


def test_every_benchmark_is_a_subcommand_with_the_harness_contract():
    assert {"quality", "quality-depth", "kernels", "kernel-streams", "cli-parity"} <= set(REGISTRY)
    for name in REGISTRY:
        module = module_of(name)
        assert module.__doc__ and callable(module.run) and callable(module.to_markdown), name
        assert build_parser().parse_args(["bench", name]).name == name


def test_a_benchmarks_own_flags_exist_on_its_parser_only():
    parsers = _parsers()
    for flag, owners in OWN_FLAGS.items():
        assert {name for name in REGISTRY if flag in parsers[name]._option_string_actions} == owners, flag
    for name, bench in REGISTRY.items():
        options = parsers[name]._option_string_actions
        assert "--json" in options and "--out" in options and ("--quick" in options) == bench.quick, name


def test_a_flag_of_another_benchmark_is_refused_naming_its_owner(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["bench", "cli-parity", "--only", "MSAR"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: unrecognized arguments: --only MSAR; --only applies to quality only; "
        "see attnres-pp bench cli-parity --help"]


def test_quality_refuses_bad_values_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quality, "run", lambda *args, **kwargs: pytest.fail("ran"))
    assert main(["bench", "quality", "--only", "nothing-like-it", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --only 'nothing-like-it' matches no variant")
    assert main(["bench", "quality", "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "error: --steps, --seeds and --jobs must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_quality_writes_its_old_file_names_through_the_writer(tmp_path, capsys, monkeypatch):
    seen = {}

    def fake_run(quick, out_dir, progress, *, steps, seeds, only, jobs):
        seen.update(quick=quick, folder=out_dir.name, steps=steps, seeds=seeds, only=only, jobs=jobs)
        return {"date": "today", "budget": {}, "rows": [], "runs": []}

    monkeypatch.setattr(quality, "run", fake_run)
    monkeypatch.setattr(quality, "to_markdown", lambda payload: "# the quality table")
    assert main(["bench", "quality", "--quick", "--only", "P-LR", "--out-dir", str(tmp_path), "--json"]) == 0
    stem = f"quality_{datetime.date.today().isoformat()}_quick_partial"
    assert seen == {"quick": True, "folder": stem, "steps": quality.QUICK_STEPS, "seeds": 1, "only": "P-LR",
                    "jobs": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.md"]
    payload = json.loads((tmp_path / f"{stem}.json").read_text())
    command = f"attnres-pp bench quality --quick --out {tmp_path} --only P-LR"
    assert payload["command"] == command and json.loads(capsys.readouterr().out) == payload
    assert {"rows", "runs", "budget", "date", "machine"} <= set(payload)
    markdown = (tmp_path / f"{stem}.md").read_text()
    assert markdown.startswith("# the quality table") and f"Command: `{command}`" in markdown
    assert "Machine: " in markdown


def test_the_lab_runs_its_studies_through_the_same_harness():
    """`attnres-lab NAME` parses like `attnres-pp bench NAME` (the common flags, a study's own flags
    on its parser only); the studies moved to the lab are no longer benchmarks of the product."""
    from attnres_lab.cli import REGISTRY as LAB
    from attnres_lab.cli import SUITE
    from attnres_lab.cli import build_parser as lab_parser

    assert {"fidelity", "memory-predict"} <= set(LAB) and not set(LAB) & set(REGISTRY)
    studies = lab_parser()._subparsers._group_actions[0].choices
    for name, study in LAB.items():
        module = SUITE.module_of(name)
        assert module.__doc__ and callable(module.run) and callable(module.to_markdown), name
        options = studies[name]._option_string_actions
        assert "--json" in options and "--out" in options and ("--quick" in options) == study.quick, name
    assert {name for name in LAB if "--hosts" in studies[name]._option_string_actions} == {"fidelity"}
    assert "--out" in studies["fit-memory-units"]._option_string_actions


@pytest.mark.parametrize("argv, sibling, name, recorded", [
    (["memory-predict", "--quick"], "memory_predict", "memory_predict_quick", "memory-predict --quick --out OUT"),
    (["fidelity", "--hosts"], "fidelity_hosts", "fidelity_hosts", "fidelity --out OUT --hosts"),
    (["fidelity", "--tp"], "fidelity_tp", "fidelity_tp", "fidelity --out OUT --tp"),
])
def test_a_lab_study_runs_under_its_name_with_the_attnres_lab_command(argv, sibling, name, recorded, tmp_path,
                                                                      monkeypatch):
    """A study (or the sibling module a flag picks) writes its files under its own name, with the
    `attnres-lab ...` command that ran it."""
    import importlib

    from attnres_lab.cli import main as lab_main

    module = importlib.import_module(f"attnres_lab.{sibling}")
    seen = {}
    monkeypatch.setattr(module, "run", lambda quick, out_dir, progress: seen.setdefault("folder", out_dir.name)
                        and {"rows": []})
    monkeypatch.setattr(module, "to_markdown", lambda payload: f"# {sibling}")
    assert lab_main([*argv, "--out", str(tmp_path)]) == 0
    stem = f"{name}_{datetime.date.today().isoformat()}"
    assert seen["folder"] == stem
    payload = json.loads((tmp_path / f"{stem}.json").read_text())
    assert payload["benchmark"] == argv[0]
    assert payload["command"] == "attnres-lab " + recorded.replace("OUT", str(tmp_path))
    assert (tmp_path / f"{stem}.md").read_text().startswith(f"# {sibling}")


def test_two_flags_that_each_pick_a_sibling_are_refused_in_one_line(tmp_path, capsys):
    from attnres_lab.cli import main as lab_main

    assert lab_main(["fidelity", "--hosts", "--tp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --hosts and --tp each pick another benchmark: give one of them"]
    assert not list(tmp_path.iterdir())


def test_results_keep_no_path_of_this_checkout(tmp_path, monkeypatch):
    """Results are committed: a trace or picture path inside the working directory (a checkout's
    root, where benchmarks run from) is written relative to it (in the JSON, nested, and in the
    markdown); a path outside it is left as it is. Results go under it by default."""
    from attnres_pp.bench import common

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    assert common.default_out_dir() == checkout.resolve() / "benchmarks" / "results"
    inside = str(checkout.resolve() / "benchmarks" / "results" / "bubbles_x" / "trace_1f1b.json")
    payload = {"rows": [{"trace": inside, "other": "/elsewhere/trace.json"}], "n": 3}
    json_path, md_path = common.write_results(tmp_path, "stem", payload, f"see {inside}\n")
    written = json.loads(json_path.read_text())
    assert written["rows"][0] == {"trace": "benchmarks/results/bubbles_x/trace_1f1b.json",
                                  "other": "/elsewhere/trace.json"}
    assert written["n"] == 3
    assert md_path.read_text() == "see benchmarks/results/bubbles_x/trace_1f1b.json\n"


def test_fit_memory_units_refuses_an_empty_fit_before_measuring(tmp_path, capsys):
    from attnres_lab.cli import main as lab_main

    out = tmp_path / "units.json"
    assert lab_main(["fit-memory-units", "--cases", "0", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --cases and --checkpoint-cases must be >= 1"]
    assert not out.exists()
