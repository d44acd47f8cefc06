"""Which split each file of a folder dataset belongs to, decided per file by a keyed hash of
its name, so that adding a file moves no other (:func:`assign_splits`).

A file's number ``u`` in [0, 1) (:func:`keyed_unit`: blake2b over the data seed, a purpose
and the name) puts it in the validation split when ``u < val_fraction``, in the test split
when ``u >= 1 - test_fraction``, and in the training split otherwise. The two held-out
intervals sit at the two ends, so a test split leaves the validation split as it is, and
another ``val_fraction`` leaves the test split as it is. Fractions are therefore met
approximately (by the law of large numbers), not to the file.

Optionally by group (a patient, a slide: ``group_regex`` or ``group_csv``): the hash is over
the group's key, so a group never straddles two splits. A split file (``split_file``)
decides instead, file by file. Folds (``folds``, ``fold``): the test split is held out first,
then the other files (or groups) fall into ``folds`` folds by another keyed hash; fold
``fold`` is the validation split, the rest the training split.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch

from repro.base.errors import DataError

SPLITS = ("train", "val", "test")
_PERSON = b"repro.split.v1"  # blake2b's personalisation: these numbers are no other hash's


def keyed_unit(seed: int, purpose: str, name: str) -> float:
    """A number in [0, 1) that depends only on ``seed``, ``purpose`` and ``name``: blake2b
    (its own personalisation) over the three, each length-prefixed, its first 53 bits over
    2**53. The name is taken in Unicode NFC, so a name that one file system stores
    decomposed (macOS) gives the number it gives elsewhere."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    parts = [str(int(seed)).encode(), purpose.encode(), _nfc(name).encode()]
    payload = b"".join(str(len(p)).encode() + b":" + p + b";" for p in parts)
    digest = hashlib.blake2b(payload, digest_size=8, person=_PERSON).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2**53


def assign_splits(
    names: Sequence[str],
    *,
    seed: int,
    val_fraction: float,
    test_fraction: float,
    path: str,
    purpose: str,
    group_regex: str | None = None,
    group_csv: str | None = None,
    split_file: str | None = None,
    folds: int = 0,
    fold: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(train, val, test)``: the sorted int64 indices into ``names`` of each split; ``test``
    is None when there is no test split. A pure function of its arguments (and of the CSV
    files named), the same in every process.

    Each file (or group) is placed by ``u = keyed_unit(seed, purpose + "/split", key)``,
    ``key`` its name or its group's key: validation when ``u < val_fraction``, test when
    ``u >= 1 - test_fraction``, training otherwise. Adding a file moves no other file, with
    one exception: a split that would be empty takes the file(s) (or group) whose ``u`` is
    nearest its boundary -- at least one in validation, in training, and in test when
    ``test_fraction > 0`` -- so in a tiny folder a new file can send such a file back.

    ``group_regex``: searched in each name, the group key is its first capture group (the
    whole match when it has none); ``group_csv``: a CSV with the columns ``file,group``. A
    group is placed as one, so none straddles two splits (or folds). ``split_file``: a CSV
    with the columns ``file,split`` (train, val or test) that lists every file and decides
    instead of the hash (with groups, a group it puts in two splits is an error).

    ``folds`` K >= 2: the test split is held out as above (or by the split file); the other
    files (or groups) fall into fold ``floor(v * K)`` by ``v = keyed_unit(seed, purpose +
    "/fold", key)``; fold ``fold`` is the validation split, the others the training split.
    ``val_fraction`` (and a split file's train/val choice) is not used then. ``path`` names
    the folder in errors. Errors a user can cause name the ``data.*`` key."""
    names = [_nfc(n) for n in names]
    _check_settings(val_fraction, test_fraction, folds, fold, group_regex, group_csv)
    keys = _group_keys(names, group_regex, group_csv)
    if split_file:
        chosen = _read_split_file(split_file, names)
        if keys is not None:
            _check_groups_kept_whole(names, keys, chosen, split_file, folds)
    else:
        unit_of = keys if keys is not None else names
        hashed = _hashed_splits(
            sorted(set(unit_of)), seed, purpose, val_fraction, test_fraction, folds, path, keys
        )
        chosen = [hashed[k] for k in unit_of]
    if folds:
        pool = keys if keys is not None else names
        fold_of = _folds(
            sorted({pool[i] for i, s in enumerate(chosen) if s != "test"}),
            seed,
            purpose,
            folds,
            path,
            keys,
        )
        chosen = [
            s if s == "test" else ("val" if fold_of[pool[i]] == fold else "train")
            for i, s in enumerate(chosen)
        ]
    index = {s: [i for i, c in enumerate(chosen) if c == s] for s in SPLITS}
    source = f"data.split_file={split_file!r}" if split_file else f"data.path={path!r}"
    for s in ("train", "val"):
        if not index[s]:  # only a split file (or folds over one) can leave one empty
            raise DataError(f"{source}: the {_WORD[s]} split holds no file; put files in it.")
    test = torch.tensor(index["test"], dtype=torch.int64) if index["test"] else None
    return (
        torch.tensor(index["train"], dtype=torch.int64),
        torch.tensor(index["val"], dtype=torch.int64),
        test,
    )


_WORD = {"train": "training", "val": "validation", "test": "test"}


def split_inputs(
    names: Sequence[str], group_csv: str | None = None, split_file: str | None = None
) -> dict[str, dict[str, object]]:
    """What decided a folder's split besides the config, as digests: the list of file names
    it was drawn from (``file_names``: their count and the SHA-256 of the NFC names, one a
    line, in sorted order) and the contents of ``data.group_csv`` and ``data.split_file``
    (their path and the SHA-256 of their bytes), where set. A grown folder, or an edited row
    of a CSV, changes the split under the same config: this is the run's record of them
    (``env.json``'s ``environment.split_inputs``, which ``repro compare`` lists and a resume
    compares; :data:`repro.records.fingerprint.SPLIT_KEY`)."""
    listed = "".join(f"{n}\n" for n in sorted(_nfc(n) for n in names)).encode()
    found: dict[str, dict[str, object]] = {
        "file_names": {"count": len(names), "sha256": hashlib.sha256(listed).hexdigest()}
    }
    for key, path in (("group_csv", group_csv), ("split_file", split_file)):
        if path:
            data = Path(path).expanduser().read_bytes()  # read (and checked) by the split
            found[key] = {"path": str(path), "sha256": hashlib.sha256(data).hexdigest()}
    return found


def limit_splits(
    splits: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    names: Sequence[str],
    limit: int | None,
    *,
    seed: int,
    purpose: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``data.limit``: at most ``limit`` files of each split, for a quick run on a large
    folder; None: all. The files kept are those with the smallest keyed number
    (``keyed_unit(seed, purpose + "/limit", name)``), so they are the same on every machine
    and in every process, a larger limit keeps them all and adds others, and no file changes
    split (the splits are the whole folder's: a limited run never validates on a file the
    full run trains on)."""
    if limit is None:
        return splits
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise DataError(
            f"data.limit={limit!r} is invalid; allowed: a whole number >= 1 (files kept from "
            "each split), or null for all."
        )

    def keep(index: torch.Tensor | None) -> torch.Tensor | None:
        if index is None or len(index) <= limit:
            return index
        u = [(keyed_unit(seed, purpose + "/limit", names[i]), i) for i in index.tolist()]
        return torch.tensor(sorted(i for _, i in sorted(u)[:limit]), dtype=torch.int64)

    train, val, test = splits
    return keep(train), keep(val), keep(test)  # type: ignore[return-value]


def _nfc(name: str) -> str:
    return unicodedata.normalize("NFC", name)


def _check_settings(
    val_fraction: float,
    test_fraction: float,
    folds: int,
    fold: int,
    group_regex: str | None,
    group_csv: str | None,
) -> None:
    if group_regex and group_csv:
        raise DataError(
            "data.group_regex and data.group_csv are both set; give one of them (the other null)."
        )
    if not 0 <= test_fraction < 1:
        raise DataError(
            f"data.test_fraction={test_fraction} is invalid; allowed: a number in [0, 1)."
        )
    if not folds:
        if not 0 < val_fraction < 1:
            raise DataError(
                f"data.val_fraction={val_fraction} is invalid; allowed: a number in (0, 1)."
            )
        if val_fraction + test_fraction >= 1:
            raise DataError(
                f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} "
                "leave no training files; make their sum below 1."
            )
    if isinstance(folds, bool) or not isinstance(folds, int) or folds == 1 or folds < 0:
        raise DataError(f"data.folds={folds} is invalid; allowed: 0 (no folds) or 2 or more.")
    if isinstance(fold, bool) or not isinstance(fold, int):
        raise DataError(f"data.fold={fold!r} is invalid; allowed: an integer, 0 to data.folds-1.")
    if not folds and fold:
        raise DataError(
            f"data.fold={fold} needs folds; set data.folds (2 or more) or leave data.fold at 0."
        )
    if folds and not 0 <= fold < folds:
        raise DataError(
            f"data.fold={fold} is out of range for data.folds={folds}; allowed: 0 to {folds - 1}."
        )


def _hashed_splits(
    units: list[str],
    seed: int,
    purpose: str,
    val_fraction: float,
    test_fraction: float,
    folds: int,
    path: str,
    keys: list[str] | None,
) -> dict[str, str]:
    """Each unit's split by its keyed number (with folds, only test or not: ``train``); a
    split that would be empty takes the unit(s) nearest its boundary."""
    u = {k: keyed_unit(seed, purpose + "/split", k) for k in units}
    ordered = sorted(units, key=lambda k: (u[k], k))
    n = len(ordered)
    least_test = 1 if test_fraction > 0 else 0
    n_test = max(least_test, sum(u[k] >= 1 - test_fraction for k in ordered)) if least_test else 0
    if folds:
        n_val = 0
        n_test = min(n_test, n - 1)  # the folds need a file; the fold check names too few
    else:
        n_val = max(1, sum(u[k] < val_fraction for k in ordered))
        what = "groups" if keys is not None else "files"
        if n < 2 + least_test:
            fill = "a training, a validation and a test split" if least_test else "both splits"
            raise DataError(f"data.path={path!r}: {n} {what} cannot fill {fill}; add files.")
        while n_val + n_test > n - 1:  # training would be empty: the larger split gives way
            if n_val > 1 and (n_val >= n_test or n_test <= least_test):
                n_val -= 1
            else:
                n_test -= 1
    out = dict.fromkeys(ordered, "train")
    out.update(dict.fromkeys(ordered[:n_val], "val"))
    out.update(dict.fromkeys(ordered[n - n_test :], "test"))
    return out


def _folds(
    units: list[str], seed: int, purpose: str, folds: int, path: str, keys: list[str] | None
) -> dict[str, int]:
    """Each unit's fold, ``floor(v * folds)``; one line naming data.folds when one is empty."""
    fold_of = {
        k: min(folds - 1, math.floor(keyed_unit(seed, purpose + "/fold", k) * folds)) for k in units
    }
    empty = sorted(set(range(folds)) - set(fold_of.values()))
    if empty:
        what = "groups" if keys is not None else "files"
        raise DataError(
            f"data.folds={folds}: fold {empty[0]} holds none of the {len(units)} {what} outside "
            f"the test split of data.path={path!r}; lower data.folds or add files."
        )
    return fold_of


def _group_keys(
    names: list[str], group_regex: str | None, group_csv: str | None
) -> list[str] | None:
    """Each name's group key, or None without groups."""
    if group_regex:
        try:
            pattern = re.compile(group_regex)
        except re.error as err:
            raise DataError(
                f"data.group_regex={group_regex!r} is not a regular expression ({err}); fix it."
            ) from None
        keys = []
        for name in names:
            match = pattern.search(name)
            key = None if match is None else match.group(1 if pattern.groups else 0)
            if key is None:
                raise DataError(
                    f"data.group_regex={group_regex!r} does not match file {name!r} of data.path "
                    "(or captures nothing in it); change the pattern or move the file out."
                )
            keys.append(key)
        return keys
    if group_csv:
        group_of: dict[str, str] = {}
        for line, row in _read_csv(group_csv, "group_csv", ("file", "group")):
            name, group = row["file"], row["group"]
            if not group:
                raise DataError(
                    f"data.group_csv={group_csv!r}: line {line} gives file {name!r} no group; "
                    "fill it in."
                )
            if group_of.setdefault(name, group) != group:
                raise DataError(
                    f"data.group_csv={group_csv!r}: line {line} puts file {name!r} in group "
                    f"{group!r}, an earlier line in {group_of[name]!r}; keep one."
                )
        for name in names:
            if name not in group_of:
                raise DataError(
                    f"data.group_csv={group_csv!r} has no row for file {name!r} of data.path; "
                    "add one (file,group)."
                )
        return [group_of[n] for n in names]
    return None


def _read_split_file(split_file: str, names: list[str]) -> list[str]:
    """Each name's split as the split file gives it."""
    known = set(names)
    split_of: dict[str, str] = {}
    for line, row in _read_csv(split_file, "split_file", ("file", "split")):
        name, split = row["file"], row["split"]
        if split not in SPLITS:
            raise DataError(
                f"data.split_file={split_file!r}: line {line} gives file {name!r} the split "
                f"{split!r}; allowed: train, val or test."
            )
        if name not in known:
            example = f" (names look like {names[0]!r})" if names else ""
            raise DataError(
                f"data.split_file={split_file!r}: line {line} names {name!r}, no file of "
                f"data.path{example}; fix the name or remove the line."
            )
        if split_of.setdefault(name, split) != split:
            raise DataError(
                f"data.split_file={split_file!r}: line {line} puts file {name!r} in {split}, "
                f"an earlier line in {split_of[name]}; keep one."
            )
    for name in names:
        if name not in split_of:
            raise DataError(
                f"data.split_file={split_file!r} has no row for file {name!r} of data.path; "
                "add one (file,split: train, val or test)."
            )
    return [split_of[n] for n in names]


def _check_groups_kept_whole(
    names: list[str], keys: list[str], chosen: list[str], split_file: str, folds: int
) -> None:
    """One line when the split file puts a group in two splits (with folds: test and not)."""
    seen: dict[str, tuple[str, str]] = {}
    for name, key, split in zip(names, keys, chosen, strict=True):
        side = ("test" if split == "test" else "not test") if folds else split
        first = seen.setdefault(key, (name, side))
        if first[1] != side:
            raise DataError(
                f"data.split_file={split_file!r} puts file {first[0]!r} in {first[1]} but "
                f"{name!r} of the same group {key!r} in {side}; give a group one split."
            )


def _read_csv(path: str, key: str, columns: tuple[str, str]) -> list[tuple[int, dict[str, str]]]:
    """The rows of the CSV file that ``data.<key>`` names, as ``(line, {column: value})``
    with the values stripped (blank rows left out); one line naming the key when the file
    is missing, unreadable or lacks a column."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(
            f"data.{key}={path!r} is not a file; give the path of a CSV file with the columns "
            f"{','.join(columns)} (absolute, or relative to the current directory)."
        )
    try:
        text = file.read_text(encoding="utf-8-sig")  # a BOM (spreadsheets write one) dropped
        reader = csv.DictReader(io.StringIO(text))
        fields = [(f or "").strip() for f in (reader.fieldnames or [])]
        missing = [c for c in columns if c not in fields]
        if missing:
            raise DataError(
                f"data.{key}={path!r} needs the columns {','.join(columns)} in its first line; "
                f"it has {','.join(fields) or 'none'}."
            )
        reader.fieldnames = fields
        rows = []
        for row in reader:
            values = {c: _nfc((row.get(c) or "").strip()) for c in columns}
            if any(values.values()):
                rows.append((reader.line_num, values))
        return rows
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(
            f"data.{key}={path!r} cannot be read as CSV ({type(err).__name__}: {err}); fix it."
        ) from None
