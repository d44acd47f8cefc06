"""Stable splits of the folder datasets (repro.components.data.splitting): a file's split is a keyed
hash of its name, so adding a file moves no other; groups, a split file and folds; the same
keys through image_mask_folder and its config; `repro report` pooling folds x seeds and
pairing jobs by (seed, fold)."""

import json
import re
import statistics
import unicodedata

import pytest
import torch
import yaml

from optional import require
from repro.base.errors import DataError
from repro.components.data.splitting import assign_splits, keyed_unit, limit_splits

KW = {"seed": 1234, "val_fraction": 0.15, "test_fraction": 0.1, "path": "d", "purpose": "t"}


def split_of(names, **kw):
    """{name: "train" | "val" | "test"} as assign_splits gives it."""
    train, val, test = assign_splits(names, **{**KW, **kw})
    out = {}
    for split, index in (("train", train), ("val", val), ("test", test)):
        for i in [] if index is None else index.tolist():
            assert names[i] not in out  # the splits are disjoint
            out[names[i]] = split
    assert sorted(out) == sorted(names)  # ... and cover every file
    return out


def test_the_keyed_number_of_a_name_is_pinned():
    """A change of the hash would move every user's files: these values must stay."""
    assert keyed_unit(1234, "image-folder/split", "cat/1.png") == 0.80194248909294
    assert keyed_unit(1234, "image-mask-folder/split", "case01") == 0.39075435940780834
    assert keyed_unit(0, "image-mask-folder/fold", "case01") == 0.5167748215696949
    name = "café"  # as macOS stores it (decomposed) and as Linux does (composed)
    nfd, nfc = unicodedata.normalize("NFD", name), unicodedata.normalize("NFC", name)
    assert nfd != nfc and keyed_unit(0, "p", nfd) == keyed_unit(0, "p", nfc)
    assert keyed_unit(0, "p", "a") != keyed_unit(1, "p", "a") != keyed_unit(0, "q", "a")


def test_adding_a_file_moves_no_other_file():
    names = [f"img{i:04d}" for i in range(300)]
    more = ["img", *names, "img0150a", "zzz"]  # new files first, between and last in order
    before, after = split_of(names), split_of(more)
    assert all(after[n] == before[n] for n in names)
    for fold in range(5):  # nor a fold
        before = split_of(names, folds=5, fold=fold)
        after = split_of(more, folds=5, fold=fold)
        assert all(after[n] == before[n] for n in names)


def test_a_test_split_or_another_val_fraction_leaves_the_other_split_as_it_is():
    names = [f"n{i}" for i in range(400)]
    without = split_of(names, test_fraction=0.0)
    held = split_of(names, test_fraction=0.2)
    assert {n for n, s in held.items() if s == "val"} == {
        n for n, s in without.items() if s == "val"
    }
    wider = split_of(names, val_fraction=0.3, test_fraction=0.2)
    assert {n for n, s in wider.items() if s == "test"} == {
        n for n, s in held.items() if s == "test"
    }


def test_fractions_are_met_approximately():
    split = split_of([f"n{i}" for i in range(2000)])
    counts = {s: sum(v == s for v in split.values()) for s in ("train", "val", "test")}
    assert counts == {"train": 1480, "val": 320, "test": 200}  # the hash, pinned
    # within 4 binomial standard deviations of 300 and 200
    assert abs(counts["val"] - 300) < 4 * (2000 * 0.15 * 0.85) ** 0.5
    assert abs(counts["test"] - 200) < 4 * (2000 * 0.1 * 0.9) ** 0.5


def test_every_split_gets_a_file_in_a_tiny_folder():
    for seed in range(40):  # many draws: the fallback takes the file nearest each boundary
        for n in (2, 3, 4, 6):
            for test_fraction in (0.0, 0.1) if n >= 3 else (0.0,):
                split = split_of(
                    [f"f{i}" for i in range(n)], seed=seed, test_fraction=test_fraction
                )
                wanted = {"train", "val", "test"} if test_fraction else {"train", "val"}
                assert set(split.values()) == wanted, (seed, n, test_fraction)
    with pytest.raises(DataError, match=r"data.path='d': 2 files cannot fill a training"):
        assign_splits(["a", "b"], **KW)


def test_groups_never_straddle_splits(tmp_path):
    names = [f"p{k:02d}_{j}" for k in range(60) for j in range(1 + k % 4)]
    by_regex = split_of(names, group_regex=r"^(p\d+)_")
    whole = split_of(names, group_regex=r"^p\d+")  # no capture group: the whole match
    rows = ["file,group"] + [f"{n},patient-{n.split('_')[0]}" for n in names]
    (tmp_path / "groups.csv").write_text("\n".join(rows) + "\n")
    by_csv = split_of(names, group_csv=str(tmp_path / "groups.csv"))
    for split in (by_regex, whole, by_csv):
        assert set(split.values()) == {"train", "val", "test"}
        for k in range(60):
            assert len({split[n] for n in names if n.startswith(f"p{k:02d}_")}) == 1
    assert by_regex == whole  # the same group keys
    with pytest.raises(DataError, match=r"data.group_regex='\^q' does not match file 'p00_0'"):
        assign_splits(names, **KW, group_regex="^q")
    (tmp_path / "short.csv").write_text("\n".join(rows[:-1]) + "\n")
    with pytest.raises(DataError, match=r"short.csv' has no row for file 'p59_3' of data.path"):
        assign_splits(names, **KW, group_csv=str(tmp_path / "short.csv"))
    with pytest.raises(DataError, match=r"data.group_regex and data.group_csv are both set"):
        assign_splits(names, **KW, group_regex="^p", group_csv=str(tmp_path / "groups.csv"))
    with pytest.raises(DataError, match=r"data.group_csv='nowhere.csv' is not a file"):
        assign_splits(names, **KW, group_csv="nowhere.csv")


def test_a_split_file_decides_and_its_errors_name_it(tmp_path):
    names = [f"s{i}" for i in range(6)]
    chosen = ["test", "train", "val", "train", "train", "val"]
    path = tmp_path / "splits.csv"
    path.write_text(
        "file,split\n" + "".join(f"{n},{s}\n" for n, s in zip(names, chosen, strict=True))
    )
    assert split_of(names, split_file=str(path)) == dict(zip(names, chosen, strict=True))
    train, val, test = assign_splits(names, **KW, split_file=str(path))
    assert (train.tolist(), val.tolist(), test.tolist()) == ([1, 3, 4], [2, 5], [0])
    assert train.dtype == torch.int64
    path.write_text("file,split\n" + "".join(f"{n},train\n" for n in names[:-1]))
    with pytest.raises(DataError, match=r"splits.csv' has no row for file 's5' of data.path"):
        assign_splits(names, **KW, split_file=str(path))
    path.write_text("file,split\n" + "".join(f"{n},train\n" for n in [*names, "s9"]))
    with pytest.raises(DataError, match=r"line 8 names 's9', no file of data.path"):
        assign_splits(names, **KW, split_file=str(path))
    path.write_text("file,split\n" + "".join(f"{n},valid\n" for n in names))
    with pytest.raises(DataError, match=r"line 2 gives file 's0' the split 'valid'; allowed: tr"):
        assign_splits(names, **KW, split_file=str(path))
    path.write_text("name,split\n")
    with pytest.raises(DataError, match=r"needs the columns file,split in its first line"):
        assign_splits(names, **KW, split_file=str(path))


def test_folds_partition_the_files_outside_the_fixed_test_split():
    names = [f"n{i}" for i in range(200)]
    splits = [split_of(names, folds=5, fold=k) for k in range(5)]
    tests = [{n for n, s in split.items() if s == "test"} for split in splits]
    assert tests[0] and all(t == tests[0] for t in tests)  # the same test split for every fold
    assert tests[0] == {n for n, s in split_of(names).items() if s == "test"}  # as without folds
    vals = [{n for n, s in split.items() if s == "val"} for split in splits]
    assert all(vals) and sum(len(v) for v in vals) == len(set().union(*vals))  # disjoint ...
    assert set().union(*vals) == set(names) - tests[0]  # ... and every non-test file once
    # with groups, a group stays in one fold
    grouped = [f"p{k}_{j}" for k in range(30) for j in range(3)]
    for k in range(3):
        split = split_of(grouped, group_regex=r"^(p\d+)_", folds=3, fold=k)
        assert all(len({split[f"p{g}_{j}"] for j in range(3)}) == 1 for g in range(30))


def test_bad_folds_are_one_line_naming_the_key():
    names = [f"n{i}" for i in range(20)]
    for kw, expected in (
        ({"folds": 1}, r"data.folds=1 is invalid; allowed: 0 \(no folds\) or 2 or more\."),
        ({"folds": 5, "fold": 5}, r"data.fold=5 is out of range for data.folds=5; allowed: 0 to 4"),
        ({"fold": 2}, r"data.fold=2 needs folds; set data.folds"),
        ({"folds": 4, "fold": -1}, r"data.fold=-1 is out of range for data.folds=4"),
    ):
        with pytest.raises(DataError, match=expected):
            assign_splits(names, **KW, **kw)
    with pytest.raises(DataError, match=r"data.folds=3: fold \d holds none of the 2 files"):
        assign_splits(["a", "b"], **{**KW, "test_fraction": 0.0}, folds=3)


def test_the_same_arguments_give_the_same_splits():
    names = [f"n{i}" for i in range(500)]
    for kw in ({}, {"folds": 4, "fold": 2}, {"group_regex": r"n(\d)"}):
        first, second = assign_splits(names, **KW, **kw), assign_splits(list(names), **KW, **kw)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b) and torch.equal(a, a.sort().values)
    other = assign_splits(names, **{**KW, "seed": 1235})
    assert not torch.equal(other[1], assign_splits(names, **KW)[1])  # the seed matters


def _mask_folder(root, stems):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, stem in enumerate(stems):
        Image.new("RGB", (4, 4), (i, 0, 0)).save(root / "images" / f"{stem}.png")
        Image.new("L", (4, 4), i % 2).save(root / "masks" / f"{stem}.png")


def test_image_mask_folder_takes_the_keys_from_its_config(tmp_path, monkeypatch):
    require("PIL")
    from repro.components.data import image_mask_folder
    from repro.defense.config import compose
    from repro.engine.build import instantiate_target

    stems = [f"p{k}_{j}" for k in range(8) for j in range(2)]
    _mask_folder(tmp_path / "d", stems)
    base = {"path": str(tmp_path / "d"), "num_classes": 2, "image_size": 4}
    for fold in range(3):
        d = image_mask_folder(**base, group_regex=r"^(p\d)_", folds=3, fold=fold, seed=7)
        got = {p.stem: s for s in ("train", "val") for p in getattr(d, s).images}
        expected = split_of(
            stems,
            seed=7,
            test_fraction=0.0,
            group_regex=r"^(p\d)_",
            folds=3,
            fold=fold,
            purpose="image-mask-folder",
        )
        assert got == expected and d.test is None
        assert all(m.stem == i.stem for i, m in zip(d.val.images, d.val.masks, strict=True))
    # a split file relative to the current directory, through the composed config
    monkeypatch.chdir(tmp_path)
    chosen = {s: ("test", "val", "train", "train")[i % 4] for i, s in enumerate(stems)}
    (tmp_path / "splits.csv").write_text(
        "file,split\n" + "".join(f"{s},{v}\n" for s, v in chosen.items())
    )
    cfg = compose(
        [
            "data=image_mask_folder",
            f"data.path={tmp_path / 'd'}",
            "data.num_classes=2",
            "data.split_file=splits.csv",
        ]
    )
    d = instantiate_target(cfg.data, "data")
    got = {p.stem: s for s in ("train", "val", "test") for p in getattr(d, s).images}
    assert got == chosen
    cfg.data.split_file = "missing.csv"
    with pytest.raises(DataError, match=r"data.split_file='missing.csv' is not a file"):
        instantiate_target(cfg.data, "data")


def test_a_limit_keeps_the_same_files_of_each_split_and_moves_none(tmp_path):
    """data.limit: at most N files of each split, by a keyed number: a larger limit keeps
    the smaller one's files, no file changes split, and the folder reads them."""
    names = [f"img{i:03d}" for i in range(200)]
    whole = assign_splits(names, **KW)
    split = split_of(names)
    kept = {}
    for limit in (5, 12, 1000):
        parts = limit_splits(whole, names, limit, seed=KW["seed"], purpose="t")
        kept[limit] = {names[i] for part in parts if part is not None for i in part.tolist()}
        for part, full in zip(parts, whole, strict=True):
            assert len(part) == min(limit, len(full)) and part.tolist() == sorted(part.tolist())
            assert set(part.tolist()) <= set(full.tolist())  # no file changes split
    assert kept[5] < kept[12] < kept[1000] == set(names)
    assert {split[n] for n in kept[5]} == {"train", "val", "test"}
    other = limit_splits(whole, names, 12, seed=KW["seed"] + 1, purpose="t")
    assert {names[i] for part in other for i in part.tolist()} != kept[12]  # keyed by the seed
    assert limit_splits(whole, names, None, seed=1, purpose="t") is whole
    for bad in (0, -3, 2.5, True):
        with pytest.raises(DataError, match=r"data.limit=.* is invalid; allowed: a whole"):
            limit_splits(whole, names, bad, seed=1, purpose="t")
    # through image_mask_folder: its splits, capped
    require("PIL")
    from repro.components.data import image_mask_folder

    stems = [f"s{i:02d}" for i in range(30)]
    _mask_folder(tmp_path / "d", stems)
    base = {"path": str(tmp_path / "d"), "num_classes": 2, "image_size": 4, "seed": 3}
    full, small = image_mask_folder(**base), image_mask_folder(**base, limit=4)
    for s in ("train", "val"):
        names_full = {p.stem for p in getattr(full, s).images}
        names_small = {p.stem for p in getattr(small, s).images}
        assert names_small <= names_full and len(names_small) == min(4, len(names_full))


def _job(sweep, num, overrides, config, summary=None):
    """A job directory as a sweep leaves it: .hydra/overrides.yaml and config.yaml, and
    summary.json when it finished (error.json when it failed)."""
    job = sweep / f"{num}_seed={config['seed']}"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if summary is None:
        (job / "error.json").write_text(json.dumps({"type": "RuntimeError", "message": "boom"}))
    else:
        (job / "summary.json").write_text(json.dumps(summary))


def _value(lr, seed, fold):
    """A job's val_accuracy: the fold matters more than the seed, and lr 0.1 gains a
    (seed, fold)-dependent amount: paired by seed alone, these would not line up."""
    return 0.5 + 0.1 * fold + 0.01 * seed + (0.02 + 0.003 * fold * (seed + 1) if lr == 0.1 else 0)


def test_report_pools_folds_and_seeds_and_pairs_by_seed_and_fold(tmp_path, monkeypatch):
    from repro.tools.report import build_report, format_markdown

    sweep, num = tmp_path / "sweep", 0
    for lr in (0.05, 0.1):
        for seed in range(2):
            for fold in range(3):
                overrides = [f"optim.lr={lr}", f"data.fold={fold}", f"seed={seed}"]
                config = {"seed": seed, "optim": {"lr": lr}, "data": {"folds": 3, "fold": fold}}
                v = _value(lr, seed, fold)
                summary = {"val_accuracy": v, "val_loss": 1 - v, "final_loss": 1 - v, "steps": 4}
                summary.update(headline="val_accuracy", higher_is_better=True)
                summary.update(metric_names=["val_accuracy", "val_loss"], weights_sha256=f"{num}")
                failed = (lr, seed, fold) == (0.1, 0, 0)  # its first finished job: fold 1
                _job(sweep, num, overrides, config, None if failed else summary)
                num += 1
    report = build_report(sweep)
    base, other = report["groups"]
    assert [g["title"] for g in report["groups"]] == ["optim.lr=0.05", "optim.lr=0.1"]
    assert [(j["seed"], j["fold"]) for j in base["jobs"]] == [
        (s, f) for s in range(2) for f in range(3)
    ]
    pooled = [_value(0.05, s, f) for s in range(2) for f in range(3)]
    assert base["metrics"]["val_accuracy"]["n"] == 6
    assert base["metrics"]["val_accuracy"]["mean"] == statistics.fmean(pooled)
    assert base["metrics"]["val_accuracy"]["sd"] == statistics.stdev(pooled)
    (c, *_) = report["comparisons"]
    pairs = [(s, f) for s in range(2) for f in range(3) if (s, f) != (0, 0)]
    assert c["paired"] and c["by_fold"] and c["seeds"] == pairs and c["n"] == 5
    diffs = [_value(0.1, s, f) - _value(0.05, s, f) for s, f in pairs]
    assert c["mean_diff"] == statistics.fmean(diffs) and c["sd_diff"] == statistics.stdev(diffs)
    # the verdict's interval: the corrected resampled t-test (Nadeau and Bengio), by hand
    import scipy.stats as sps

    d = c["decision"]
    assert d["folds_corrected"] == {"folds": 3, "factor": 1 + 5 / 2}
    se = (statistics.variance(diffs) * (1 / 5 + 1 / (3 - 1))) ** 0.5
    t = statistics.fmean(diffs) / se
    assert d["se"] == pytest.approx(se, rel=1e-12) and d["df"] == 4
    assert d["p_value"] == pytest.approx(2 * sps.t.sf(abs(t), 4), rel=1e-9)
    assert (d["ci95"][1] - d["ci95"][0]) > 1.8 * (c["ci95"][1] - c["ci95"][0])  # sqrt(3.5)
    assert "widened for the 3 folds' shared training files" in c["verdict"]
    assert c["config_differs"] == ["optim.lr: 0.05 -> 0.1"]  # not data.fold
    assert {(x["side"], x["seed"], x["fold"], x["why"]) for x in c["left_out"]} == {
        ("group", 0, 0, "failed"),
        ("baseline", 0, 0, "no finished job of the group has this seed and fold"),
    }
    assert (
        c["verdict"].startswith("higher (better) by ")
        and "over 5 (seed, fold) pairs" in (c["verdict"])
    )
    text = format_markdown(report, {})
    assert "| job | seed | fold | status | val_accuracy |" in text
    # the figures say that folds vary too (not "each seed")
    import repro.tools.comparisons as comparisons
    import repro.tools.report as reporting

    titles = []

    def keep(fig, path):
        titles.extend(t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")))

    monkeypatch.setattr(reporting, "save_figure", keep)
    monkeypatch.setattr(comparisons, "save_figure", keep)
    require("matplotlib")
    reporting.plot(report, tmp_path)
    assert "each (seed, fold) pair (lines join one across groups)" in titles, titles
    assert not any(t.startswith("each seed") for t in titles)
    assert "| 4_seed=1 | 1 | 1 | ok | 0.6100 |" in text
    assert "- 6_seed=0 (seed 0, fold 0): failed: RuntimeError: boom" in text
    assert "left out: seed 0 fold 0 of the group (failed)" in text
    assert "folds share their training files" in text
    # every table has as many cells in its delimiter and body rows as in its header
    for table in text.split("\n\n"):
        rows = [r for r in table.splitlines() if r.startswith("|")]
        assert len({r.count("|") for r in rows}) <= 1, rows[:3]


@pytest.mark.parametrize("layout", ["image_mask_folder", "image_folder"])
def test_a_file_name_that_is_not_utf8_is_one_line_naming_it(tmp_path, layout):
    """Bytes a file system holds but no text encodes (Latin-1 names copied from an old
    archive): the split hashes the name's text, so the file is named, not a traceback."""
    import os

    from repro.components.data import image_folder, image_mask_folder

    root = tmp_path / "data"
    if layout == "image_mask_folder":
        _mask_folder(root, ["a", "b", "c"])
        bad = [os.fsencode(root / k / "c.png") for k in ("images", "masks")]
        build = lambda: image_mask_folder(str(root), num_classes=2, channels=1)  # noqa: E731
    else:
        from PIL import Image

        for cls in ("ant", "bee"):
            (root / cls).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (8, 8)).save(root / cls / f"{i}.png")
        bad = [os.fsencode(root / "bee" / "1.png")]
        build = lambda: image_folder(str(root))  # noqa: E731
    for name in bad:
        try:
            os.rename(
                name, name.replace(b"/1.png", b"/\xe91.png").replace(b"/c.png", b"/\xe9c.png")
            )
        except OSError:  # APFS, NTFS: names must be text there, and the case cannot arise
            pytest.skip("this file system refuses file names that are not UTF-8")
    renamed = bad[0].replace(b"/1.png", b"/\xe91.png").replace(b"/c.png", b"/\xe9c.png")
    message = f"data.path={str(root)!r}: the file name {renamed!r} is not UTF-8 text; rename it"
    with pytest.raises(DataError, match=f"^{re.escape(message)}"):
        build()
