"""Hyperparameter search (hparams_search=..., Hydra's Optuna sweeper): every trial is an
ordinary run (`repro rerun` gives its bits), the objective is the headline metric, and
`repro confirm` re-runs the top trials over fresh seeds and compares them seed by seed."""

import json
from types import SimpleNamespace

import pytest

import launch
from conftest import CONF_DIR, TINY, repro, train_cmd, user_env
from optional import require
from repro.base.errors import ConfigError, MissingPackage
from repro.defense.config import check_overrides


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """Three trials of the default run's search preset, at a tiny size."""
    require("hydra_plugins.hydra_optuna_sweeper", "pip install -e '.[dev]'")
    cwd = tmp_path_factory.mktemp("search")
    sweep_dir = cwd / "search"
    proc = launch.run(
        train_cmd(
            "-m",
            "hparams_search=convnet",
            "hydra.sweeper.n_trials=3",
            *TINY,
            f"hydra.sweep.dir={sweep_dir}",
        ),
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


def summaries(sweep_dir):
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")}


@pytest.mark.e2e
def test_the_search_runs_its_trials_on_the_headline_metric(search):
    trials = summaries(search)
    assert sorted(trials) == ["0_seed=0", "1_seed=0", "2_seed=0"]
    lrs = set()
    for name in trials:
        overrides = (search / name / ".hydra" / "overrides.yaml").read_text()
        lrs |= {line for line in overrides.splitlines() if line.startswith("- optim.lr=")}
    assert len(lrs) == 3  # the sampler chose a learning rate per trial
    from repro.tools.report import load_yaml

    best = load_yaml(search / "optimization_results.yaml")
    assert best["best_value"] == max(s["val_accuracy"] for s in trials.values())


@pytest.mark.e2e
def test_a_trial_rerun_alone_gives_its_bits(search):
    job = search / "1_seed=0"
    out = repro("rerun", str(job))
    assert out.returncode == 0, out.stdout + out.stderr
    weights = summaries(search)["1_seed=0"]["weights_sha256"]
    assert out.stdout.splitlines()[0] == f"identical: 6 steps, weights {weights}"
    (rerun_dir,) = (job / "rerun").iterdir()  # by default beside the job, in rerun/<time>
    assert json.loads((rerun_dir / "summary.json").read_text())["weights_sha256"] == weights


@pytest.mark.e2e
def test_confirm_reruns_the_top_trials_over_fresh_seeds(search, tmp_path, monkeypatch):
    """In this process, its `python train.py -m ...` sweeps forked (tests/launch.py: the
    same processes, without an interpreter's start each); the command line's wiring below."""
    from repro.tools import search as confirming

    monkeypatch.setattr(confirming, "subprocess", SimpleNamespace(run=launch.run))
    out_dir = tmp_path / "confirm"
    report, text, _ = confirming.confirm(search, 2, 2, out_dir, log=lambda m: None, sesoi=0.01)
    assert report["failed_launches"] == 0
    assert json.loads((out_dir / "report.json").read_text())["search"] == report["search"]
    ranked = sorted(summaries(search).values(), key=lambda s: -s["val_accuracy"])
    first = report["search"]["trials"][0]
    assert first["search_value"] == ranked[0]["val_accuracy"]
    assert report["search"]["seeds"] == [1, 2]  # fresh: the search ran seed 0
    jobs = [j for g in report["groups"] for j in g["jobs"]]
    assert sorted(j["seed"] for j in jobs) == [1, 1, 2, 2] and report["ok"] == 4
    (c,) = report["comparisons"]
    assert c["paired"] and c["n"] == 2 and c["baseline"].startswith("trial-1")
    assert "Best mean over the fresh seeds: search rank" in text
    # the report's verdict on the headline decides whether rank 1 is confirmed (δ = 0.01)
    confirmed = report["search"]["confirmation"]
    assert confirmed["delta"] == 0.01 and c["decision"]["sesoi"] == 0.01
    assert confirmed["confirmed"] == (c["outcome"] == "worse by more than δ")
    assert ("**Confirmed**" if confirmed["confirmed"] else "**Not confirmed**") in text
    # each confirmed job is an ordinary run of the trial's config at its seed
    trial_1 = [o for o in first["overrides"] if o.startswith("optim.")]
    overrides = (next((out_dir / "trial-1").glob("0_*")) / ".hydra" / "overrides.yaml").read_text()
    assert all(f"- {o}" in overrides for o in trial_1) and "hparams_search" not in overrides
    # the command line: its arguments checked before anything runs, in one line
    for args, expected in (
        (["--top", "1", "--", "hydra/launcher=parallel"], "--top 1: give 2 or more"),
        (["--seeds", "1"], "--seeds 1: give 2 or more"),
        (["--out", str(out_dir)], "exists and is not empty; give another --out"),
    ):
        cli = repro("confirm", str(search), *args)
        assert cli.returncode == 2 and expected in cli.stderr, cli.stderr
        assert len(cli.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_confirm_refuses_a_trial_whose_config_would_not_repeat(search, tmp_path):
    """A trial whose recorded config its overrides no longer compose (a search preset that
    set a run key, or conf/ edited since): refused before anything runs, naming the key."""
    import shutil

    from repro.base.errors import ReproError
    from repro.tools.search import confirm

    copy = tmp_path / "search"
    shutil.copytree(search, copy)
    for config in copy.glob("*/.hydra/config.yaml"):
        config.write_text(config.read_text().replace("momentum: 0.9", "momentum: 0.8"))
    with pytest.raises(ReproError, match=r"compose another config than it ran \(optim.momentum\)"):
        confirm(copy, 2, 2, tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_confirm_takes_a_search_launched_with_run_control_keys(tmp_path):
    """A search launched with `trainer.resume=auto trainer.progress=false` (what docs/tools.md
    tells SLURM sweeps to pass): those keys say how the trials ran, not what they computed,
    so they are no difference on either side; a key that computes still is. The sweep's
    files are written here as Hydra would, nothing trained."""
    from omegaconf import OmegaConf

    from repro.base.errors import ReproError
    from repro.defense.config import compose
    from repro.tools.search import check_the_config_repeats, top_trials

    run_control = ["trainer.resume=auto", "trainer.progress=false", "trainer.resume_force=true"]
    for num, lr in enumerate(["0.05", "0.1"]):
        job = tmp_path / f"{num}_seed=0"
        (job / ".hydra").mkdir(parents=True)
        overrides = ["hparams_search=convnet", f"optim.lr={lr}", *run_control]
        (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
        config = OmegaConf.to_yaml(compose([f"optim.lr={lr}", *run_control]))
        (job / ".hydra" / "config.yaml").write_text(config)
        summary = {"headline": "val_accuracy", "val_accuracy": 0.5 + num / 10}
        (job / "summary.json").write_text(json.dumps(summary))
    trials, seeds, _ = top_trials(tmp_path, 2)
    assert [t.overrides for t in trials] == [["optim.lr=0.1"], ["optim.lr=0.05"]] and seeds == [0]
    for t in trials:
        check_the_config_repeats(t)  # no difference: the run-control keys do not count
    config = trials[0].job.dir / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("momentum: 0.9", "momentum: 0.8"))
    with pytest.raises(ReproError, match=r"compose another config than it ran \(optim.momentum\)"):
        check_the_config_repeats(trials[0])


def test_a_cross_validated_searchs_folds_are_replicates_not_trials(tmp_path):
    """A search over data.fold=0,1,2 x two learning rates: its top trials are the 2 configs,
    each pooled over its 3 folds (not 6 trials, one a fold), ranked by the mean over them;
    its config check composes each job's own fold (confirm re-runs every fold: Trial.folds)."""
    from omegaconf import OmegaConf

    from repro.defense.config import compose
    from repro.tools.search import check_the_config_repeats, top_trials

    num = 0
    for lr, level in (("0.05", 0.6), ("0.1", 0.4)):
        for fold in range(3):
            job = tmp_path / f"{num}_seed=0"
            (job / ".hydra").mkdir(parents=True)
            data = ["data=image_folder", f"data.path={tmp_path}", "data.folds=3"]
            folds = [*data, f"data.fold={fold}"]
            overrides = ["hparams_search=convnet", f"optim.lr={lr}", *folds]
            (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
            config = compose([f"optim.lr={lr}", *folds])
            (job / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))
            value = level + (0.5 if (lr, fold) == ("0.1", 2) else 0.0)  # one lucky fold: 0.9
            summary = {"headline": "val_accuracy", "val_accuracy": value}
            (job / "summary.json").write_text(json.dumps(summary))
            num += 1
    trials, _, _ = top_trials(tmp_path, 3)
    assert [t.overrides for t in trials] == [["optim.lr=0.05", *data], ["optim.lr=0.1", *data]]
    assert [t.folds for t in trials] == [[0, 1, 2], [0, 1, 2]]
    # ranked by the mean over the folds (0.6 against 0.567), not by the luckiest fold (0.9)
    assert trials[0].value == pytest.approx(0.6) and trials[1].value == pytest.approx(1.7 / 3)
    for t in trials:
        check_the_config_repeats(t)  # composed with its job's own data.fold


def test_search_presets_need_the_multirun_flag_and_their_experiment():
    require("hydra_plugins.hydra_optuna_sweeper", "pip install -e '.[dev]'")  # said first
    with pytest.raises(ConfigError, match="add -m"):
        check_overrides(["hparams_search=convnet"], CONF_DIR, multirun=False)
    with pytest.raises(ConfigError, match="add experiment=segmentation"):
        check_overrides(["-m", "hparams_search=segmentation"], CONF_DIR, multirun=True)
    for args, multirun in (
        (["-m", "experiment=segmentation", "hparams_search=segmentation"], True),
        (["hparams_search=convnet", "--cfg", "hydra"], False),  # looks, runs nothing
        (["-m", "hparams_search=null"], True),
    ):
        check_overrides(args, CONF_DIR, multirun=multirun)


def test_a_missing_optuna_sweeper_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if "optuna" in name else real(name, *a),
    )
    with pytest.raises(MissingPackage, match="make add PKG=hydra-optuna-sweeper") as err:
        check_overrides(["-m", "hparams_search=convnet"], CONF_DIR, multirun=True)
    assert err.value.package == "hydra-optuna-sweeper"
