"""The ``repro`` command: the project's tools as subcommands (also ``python -m repro``).

Training itself is ``python train.py ...`` (Hydra's command line)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from repro.base.errors import ReproError
from repro.base.files import OVERRIDES_FILE


def _checkpoint_path(path: Path, name: str = "checkpoint.pt") -> Path:
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise ReproError(f"{path}: no such checkpoint; give a checkpoint file or a run directory.")
    return path


def cmd_digest(args: argparse.Namespace) -> int:
    """Print the weights' SHA-256 of a checkpoint (same as summary.json's weights_sha256)."""
    from repro.records.checkpoint import load_checkpoint
    from repro.records.trace import state_dict_sha256

    path = _checkpoint_path(Path(args.path))
    state = load_checkpoint(path, require_checksum=False)  # a sidecar, when there, must match
    print(f"{state_dict_sha256(state['model'])}  {path}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    """Print the environment fingerprint as JSON."""
    from repro.records.fingerprint import environment

    print(json.dumps(environment(), indent=2))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare two runs: identical bits (exit 0), or the first divergent step (exit 1)."""
    from repro.tools.compare import compare_dirs

    if args.tolerance is not None and not args.tolerance >= 0:
        raise ReproError(f"--tolerance {args.tolerance}: give a number >= 0 (e.g. 1e-3).")
    result = compare_dirs(args.run_a, args.run_b, args.tolerance)
    print(result.text())
    return result.exit_code


def cmd_doctor(args: argparse.Namespace) -> int:
    """Find the modules of the configured model that are nondeterministic on this device
    (--cost: where strict mode costs time, module by module)."""
    from repro.defense.config import compose
    from repro.engine.doctor import run_cost, run_doctor

    if args.repeats is not None and args.repeats < 2:
        raise ReproError(f"--repeats {args.repeats}: give 2 or more.")
    cfg = compose(args.overrides, Path(args.config_dir) if args.config_dir else None)
    if args.cost:
        cost = run_cost(cfg, repeats=args.repeats or 10, log=lambda m: print(m, file=sys.stderr))
        print(cost.format(rows=args.rows))
        return 1 if cost.raises else 0
    args.repeats = args.repeats or 4
    report = run_doctor(cfg, repeats=args.repeats, log=lambda m: print(m, file=sys.stderr))
    print(report.format())
    return 0 if report.clean else 1


def cmd_preview(args: argparse.Namespace) -> int:
    """Show what the training augmentation does: a PNG of N training samples, raw and as
    training sees them in epoch E (segmentation: with the mask), and each transform's mean
    displacement and intensity change, flagging one with no visible effect."""
    from repro.defense.config import compose
    from repro.tools.preview import check_counts, run_preview, write_preview

    check_counts(args.n, args.epoch)  # before the data is built
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ReproError(f"{out}: exists; give another --out, or --force to overwrite it.")
    cfg = compose(args.overrides)
    preview = run_preview(cfg, n=args.n, epoch=args.epoch)
    write_preview(preview, out, force=args.force)
    print(preview.format())
    print(f"wrote {out}: a row per sample; " + ", ".join(preview.columns()), file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Summarise seed sweeps (per-seed table, mean, SD, 95% CI, outliers, curves) and compare
    their groups with a baseline, seed by seed: is B better than A?"""
    from repro.tools.report import write_report

    report, text, written = write_report(
        [Path(d) for d in args.dirs],
        Path(args.out) if args.out else None,
        args.baseline,
        args.metric,
        args.sesoi,
    )
    print(text)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    unfinished = report["failed"] + report["incomplete"] + report["not_started"]
    unfinished += len(report["unplaced"])  # job directories without a launch record
    return 0 if unfinished == 0 else 1


def cmd_rerun(args: argparse.Namespace) -> int:
    """Re-run one job of a sweep alone (same overrides) and check it gives the same bits."""
    import datetime as dt
    import subprocess

    from repro.base.files import SUMMARY_FILE, hydra_quoted
    from repro.defense.config import find_conf_dir
    from repro.records.trust import check_received
    from repro.tools.compare import compare_dirs

    job = Path(args.job_dir)
    overrides = launch_overrides(job, "a job directory of a sweep")
    conf = find_conf_dir(received=job)  # never a conf/ (or train.py) inside the job's folder
    # before train.py starts: a received job's record must not run code (docs/trust.md)
    check_received(
        overrides, job / OVERRIDES_FILE, trust=args.trust, loaders=args.trust_loader, conf_dir=conf
    )
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if not args.out and (job / "rerun").is_symlink():  # a received job's: leads elsewhere
        raise ReproError(
            f"{job / 'rerun'} is a symbolic link; a re-run is never written through one: "
            "give --out, or remove the link."
        )
    out = Path(args.out) if args.out else job / "rerun" / stamp
    if out.exists() and any(out.iterdir()):
        raise ReproError(f"{out}: exists and is not empty; give another --out.")
    train_py = conf.parent / "train.py"
    cmd = [sys.executable, str(train_py), *overrides, f"hydra.run.dir={hydra_quoted(str(out))}"]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    # training output to stderr: stdout is the verdict
    proc = subprocess.run(cmd, stdout=sys.stderr)
    if proc.returncode != 0:
        raise ReproError(f"the re-run failed (exit status {proc.returncode}); see {out}.")
    if not (job / SUMMARY_FILE).is_file():
        print(
            f"re-ran into {out}; the original job did not finish, so there is nothing to compare."
        )
        return 0
    result = compare_dirs(job, out)
    print(result.text())
    return result.exit_code


def cmd_confirm(args: argparse.Namespace) -> int:
    """Re-run a search's top trials over fresh seeds and compare them seed by seed: choose
    the winner on a distribution, not on one lucky seed."""
    from repro.tools.search import confirm

    report, text, written = confirm(
        Path(args.sweep_dir),
        args.top,
        args.seeds,
        Path(args.out) if args.out else None,
        args.overrides,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        trust=args.trust,
        trust_loaders=args.trust_loader,
        sesoi=args.sesoi,
    )
    print(text)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    unfinished = report["failed"] + report["incomplete"] + report["not_started"]
    return 0 if unfinished == 0 and not report["failed_launches"] else 1


def launch_overrides(run_dir: Path, what: str = "the directory of a run") -> list[str]:
    """The overrides a run was launched with (``.hydra/overrides.yaml``), less those that
    only say how it ran (resumed, with a progress bar, as a trial of a search); one line if
    they cannot be read."""
    from repro.defense.config import RUN_CONTROL, SEARCH_CONTROL
    from repro.tools.report import load_yaml, override_key

    launch = run_dir / OVERRIDES_FILE
    if not launch.is_file():
        raise ReproError(f"{run_dir}: no .hydra/overrides.yaml; give {what}.")
    overrides = load_yaml(launch, "the run's record of its launch is damaged: restore it")
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ReproError(
            f"{launch}: not a list of overrides; the run's record of its launch is damaged: "
            "restore it."
        )
    return [
        o
        for o in overrides
        if override_key(o) not in RUN_CONTROL
        and not any(
            override_key(o) == k or override_key(o).startswith(k + ".") for k in SEARCH_CONTROL
        )
    ]


def _run_config(
    run_dir: Path,
    overrides: list[str],
    trust: bool = False,
    loaders: list[str] | None = None,
    training_data: bool = True,
):
    """A run's config, composed again from its launch's overrides (``.hydra/overrides.yaml``,
    as ``repro rerun`` does) plus ``overrides``, once :func:`repro.records.trust.check_received`
    has found nothing in it that would run code the user has not trusted (``trust``,
    ``loaders``: ``--trust``, ``--trust-loader``). ``training_data`` False: its ``data.path``
    need not exist (:func:`repro.defense.config.validate`)."""
    from repro.defense.config import compose, find_conf_dir
    from repro.records.trust import check_received

    received = launch_overrides(run_dir)
    conf = find_conf_dir(received=run_dir)  # the checkout's: never one inside the run
    check_received(
        received, run_dir / OVERRIDES_FILE, overrides, trust=trust, loaders=loaders or [],
        conf_dir=conf,
    )  # fmt: skip
    return compose([*received, *overrides], conf, training_data=training_data)


def _prepared(args: argparse.Namespace, training_data: bool = True):
    """The run's config, this process under its determinism settings, and the device
    (``training_data``: see :func:`_run_config`)."""
    from repro.defense.determinism import apply_determinism
    from repro.defense.process_env import pin_process_environment
    from repro.engine.settle import resolve_device

    cfg = _run_config(
        Path(args.run_dir), args.overrides, args.trust, args.trust_loader, training_data
    )
    pin_process_environment(cfg.determinism)  # strict: re-executes once, as train.py does
    device = resolve_device(str(cfg.device))
    apply_determinism(cfg, device)
    return cfg, device


def cmd_evaluate(args: argparse.Namespace) -> int:
    """A run's checkpoint on its data's test split (or --split val, or every file of an
    annotated --folder), under the run's config and determinism settings: the same bits as
    trainer.test=true gave at the end of the run."""
    from repro.engine.inference import choose_checkpoint, evaluate_checkpoint, evaluate_folder

    out = Path(args.out) if args.out else None
    per_sample = out.with_name(f"{out.stem}_per_image.csv") if out else None
    for path in (out, per_sample):
        if path is not None and path.exists():
            raise ReproError(f"{path}: exists; give another --out (nothing was overwritten).")
    folder = Path(args.folder) if args.folder else None
    if folder is not None and not folder.is_dir():
        raise ReproError(f"--folder {folder}: not a directory; give an annotated folder.")
    if folder is not None and args.split is not None:
        raise ReproError("give --folder or --split, not both: a folder is evaluated whole.")
    cfg, device = _prepared(args, training_data=folder is None)  # --folder: the record's
    checkpoint = choose_checkpoint(Path(args.run_dir), cfg, args.checkpoint)
    if folder is not None:
        result = evaluate_folder(cfg, checkpoint, device, folder, args.force, per_sample)
    else:
        split = args.split or "test"
        result = evaluate_checkpoint(
            cfg, checkpoint, device, split, force=args.force, per_sample=per_sample
        )
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """A run's model on every image under INPUT_DIR: class probabilities as CSV, or a folder
    of PNG masks for segmentation; deterministic (the same bytes on every call)."""
    from repro.engine.inference import choose_checkpoint, predict

    out, inputs = Path(args.out), Path(args.input_dir)
    if out.exists():
        raise ReproError(f"{out}: exists; give another --out (nothing was overwritten).")
    if not inputs.is_dir():
        raise ReproError(f"{inputs}: not a directory; give a folder of images.")
    cfg, device = _prepared(args, training_data=False)  # the checkpoint's record of it
    checkpoint = choose_checkpoint(Path(args.run_dir), cfg, args.checkpoint)
    count = predict(
        cfg, checkpoint, device, inputs, out, args.force, args.probabilities, args.overlay
    )
    print(f"{count} inputs, {checkpoint.name}: wrote {out}", file=sys.stderr)
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    """Start a project of your own: src/NAME/ (model, data, task), conf/*/NAME.yaml and a
    preset, tests/test_NAME.py (the promise, checked for it); --task segmentation: a UNet on
    an image and mask folder; --remove-examples removes the template's dated benchmark
    records."""
    from repro.defense.config import find_conf_dir
    from repro.tools.scaffold import new_project, remove_examples

    if args.name is None and not args.remove_examples:
        raise ReproError("give a project name (repro new mylab), or --remove-examples.")
    try:
        root = find_conf_dir().parent
    except ReproError:
        raise ReproError(
            "no conf/train.yaml here or next to the repro package; run repro new from the "
            "template's checkout."
        ) from None
    if args.name is not None:
        for path in new_project(args.name, root, args.task):
            print(f"wrote {path.relative_to(root)}")
        first = (
            f"python -m {args.name}.data data/{args.name} (an example folder; or set data.path "
            f"in conf/data/{args.name}.yaml), then "
            if args.task == "segmentation"
            else ""
        )
        print(
            f"next: {first}python train.py experiment={args.name}; make test runs "
            f"tests/test_{args.name}.py with the template's tests; commit the new files (until "
            "then env.json marks the runs dirty)"
        )
    if args.remove_examples:
        removed = remove_examples(root)
        print(
            f"removed {len(removed)} dated records from benchmarks/ (their links in the docs "
            "are plain text now); benchmarks/README.md starts afresh"
        )
    return 0


def _doc(func) -> str:
    """A command's docstring as argparse help text (which treats % as a format character)."""
    return (func.__doc__ or "").replace("%", "%%")


def _add_trust_options(p: argparse.ArgumentParser) -> None:
    """``--trust`` and ``--trust-loader``: what a received run directory may run (docs/trust.md)."""
    p.add_argument(
        "--trust",
        action="store_true",
        help="build what the run's .hydra/overrides.yaml names although it is not in this "
        "checkout's src/ nor in the listed libraries (docs/trust.md): only for a run you wrote "
        "or whose sender you trust",
    )
    p.add_argument(
        "--trust-loader",
        action="append",
        default=[],
        metavar="NAME",
        help="allow this loader that can run the code a file holds (torch.load without "
        "weights_only=true, numpy.load with allow_pickle, pickle.*, ...), refused even with "
        "--trust unless named (repeatable)",
    )


def _add_preview_command(sub: argparse._SubParsersAction) -> None:
    """``repro preview``: what the training augmentation does to the samples."""
    p = sub.add_parser("preview", help=_doc(cmd_preview), description=cmd_preview.__doc__)
    p.add_argument(
        "overrides", nargs="*", help="the same overrides as train.py, e.g. augment=segmentation"
    )
    p.add_argument("--n", type=int, default=8, help="training samples shown (default 8)")
    p.add_argument("--epoch", type=int, default=0, help="the epoch whose draws to show (default 0)")
    p.add_argument("--out", default="preview.png", help="the PNG (default preview.png)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_preview)


def _add_sweep_commands(sub: argparse._SubParsersAction) -> None:
    """``repro report`` and ``repro confirm``: seed sweeps, comparisons, searches."""
    p = sub.add_parser("report", help=_doc(cmd_report), description=cmd_report.__doc__)
    p.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="a sweep's directory (multirun/<date>/<time>_<id>) or a run's; several are "
        "compared with each other, their jobs matched by seed",
    )
    p.add_argument(
        "--baseline",
        help="the group the others are compared with: overrides (and directories) that name "
        "it, e.g. 'optim.lr=0.1' (default: the first group)",
    )
    p.add_argument(
        "--metric",
        action="append",
        help="compare this metric too (repeatable; 'all': every metric); the headline always",
    )
    _add_sesoi_option(p)
    p.add_argument(
        "--out",
        help="where to write report.md/.json and the figures (default: the directory; for "
        "several, reports/<date>_<time>)",
    )
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("confirm", help=_doc(cmd_confirm), description=cmd_confirm.__doc__)
    p.add_argument(
        "sweep_dir", help="the search's directory (python train.py -m hparams_search=...)"
    )
    p.add_argument("--top", type=int, default=3, help="trials to re-run, best first (default 3)")
    p.add_argument("--seeds", type=int, default=5, help="fresh seeds a trial (default 5)")
    p.add_argument("--out", help="where (default SWEEP_DIR/confirm_<date>_<time>)")
    _add_sesoi_option(p)
    p.add_argument(
        "overrides",
        nargs="*",
        help="added to every run, e.g. hydra/launcher=parallel (after --)",
    )
    _add_trust_options(p)
    p.set_defaults(func=cmd_confirm)


def _sesoi(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive difference of the headline, e.g. 0.01"
        )
    return value


def _add_sesoi_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sesoi",
        type=_sesoi,
        metavar="DELTA",
        help="the smallest difference of the headline that matters (e.g. 0.01): the verdict "
        "becomes better or worse by more than it, equivalent within ±DELTA, or can't tell "
        "(default: report.sesoi of the baseline's config, if set)",
    )


def _add_new_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new", help=_doc(cmd_new), description=cmd_new.__doc__)
    p.add_argument("name", nargs="?", help="the project's name: a lowercase identifier (mylab)")
    p.add_argument(
        "--task",
        choices=["classification", "segmentation"],
        default="classification",
        help="what the project learns: class labels (the default) or per-pixel masks from an "
        "image and mask folder",
    )
    p.add_argument(
        "--remove-examples",
        action="store_true",
        help="remove the template's dated benchmark records (benchmarks/*-YYYY-MM-DD-*)",
    )
    p.set_defaults(func=cmd_new)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="repro", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("digest", help=_doc(cmd_digest))
    p.add_argument("path", help="checkpoint file, or a run directory holding checkpoint.pt")
    p.set_defaults(func=cmd_digest)
    p = sub.add_parser("compare", help=_doc(cmd_compare), description=cmd_compare.__doc__)
    p.add_argument("run_a", help="run directory (holds trace.jsonl, env.json)")
    p.add_argument("run_b", help="run directory to compare with")
    p.add_argument(
        "--tolerance",
        type=float,
        metavar="RTOL",
        help="for runs that cannot be bit-equal (other GPU, torch): report the largest "
        "loss-curve and final-metric deviation; exit 0 when all are within RTOL (relative; "
        "absolute for accuracy)",
    )
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser(
        "doctor",
        help=_doc(cmd_doctor),
        description=cmd_doctor.__doc__ + " Exit 0 when strict mode is clean, 1 when not.",
    )
    p.add_argument(
        "overrides", nargs="*", help="the same overrides as train.py, e.g. model=resnet18"
    )
    p.add_argument("--repeats", type=int, help="forward+backward repeats (default 4; --cost: 10)")
    p.add_argument(
        "--cost",
        action="store_true",
        help="time each module forward+backward under strict vs fast flags; name the "
        "expensive ones and their repro.components.ops replacement (exit 1 if strict raises)",
    )
    p.add_argument("--rows", type=int, default=12, help="--cost: modules listed (default 12)")
    p.add_argument("--config-dir", help="the conf/ directory (default: ./conf, else the project's)")
    p.set_defaults(func=cmd_doctor)
    _add_preview_command(sub)
    _add_sweep_commands(sub)
    p = sub.add_parser("rerun", help=_doc(cmd_rerun), description=cmd_rerun.__doc__)
    p.add_argument("job_dir", help="one job's directory inside a sweep directory")
    p.add_argument("--out", help="run directory for the re-run (default JOB_DIR/rerun/<time>)")
    _add_trust_options(p)
    p.set_defaults(func=cmd_rerun)
    for name, func in (("evaluate", cmd_evaluate), ("predict", cmd_predict)):
        p = sub.add_parser(name, help=_doc(func), description=func.__doc__)
        p.add_argument("run_dir", help="the run's directory")
        if name == "predict":
            p.add_argument("input_dir", help="a folder of images (searched recursively)")
        p.add_argument(
            "overrides", nargs="*", help="after the run's own overrides, e.g. device=cpu"
        )
        p.add_argument(
            "--checkpoint",
            default="best",
            help="best (best.pt, else the final checkpoint; the default), last, or a file",
        )
        p.add_argument(
            "--force",
            action="store_true",
            help="go on when the config differs from the checkpoint's where it can change the "
            "result (refused without it): evaluate records the differences in its result, "
            "predict says them on stderr",
        )
        if name == "evaluate":
            p.add_argument("--split", choices=["test", "val"], help="test (the default) or val")
            p.add_argument(
                "--folder",
                help="evaluate every file of this annotated folder instead (the run's layout: "
                "images/ and masks/, or a sub-folder per class); metrics named external_*",
            )
            p.add_argument(
                "--out",
                help="also write the result here (JSON), and each sample's row beside it "
                "(<name>_per_image.csv)",
            )
        else:
            p.add_argument("--out", required=True, help="CSV file (classification) or folder")
            p.add_argument(
                "--probabilities",
                action="store_true",
                help="segmentation: also <file>.npy, each class's probability (float32 C×H×W)",
            )
            p.add_argument(
                "--overlay",
                action="store_true",
                help="segmentation: also <file>.overlay.png, the image tinted by its classes",
            )
        _add_trust_options(p)
        p.set_defaults(func=func)
    _add_new_command(sub)
    p = sub.add_parser("env", help=_doc(cmd_env))
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # training overrides after `--` (`repro confirm DIR --top 3 -- hydra/launcher=parallel`):
    # argparse alone fills a trailing positional list only when no option comes before it
    after = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = build_parser()
    args, extra = parser.parse_known_args(
        argv[: len(argv) - len(after) - 1] if "--" in argv else argv
    )
    # overrides after an option (`repro predict RUN IMAGES --out F device=cpu`): argparse
    # fills a positional list from one run of arguments, so they arrive here
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    if after:
        if not hasattr(args, "overrides"):
            parser.error(f"repro {args.command} takes no overrides after --")
        args.overrides = [*(args.overrides or []), *after]
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is caught
        return status
    except ReproError as err:
        print(f"repro {args.command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _end_as_unix_tools_do()


def _end_as_unix_tools_do() -> NoReturn:
    """The reader of our output went away (``repro compare A B | head``): end quietly, killed
    by SIGPIPE as ``yes | head`` ends, not with a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    raise SystemExit(128 + signal.SIGPIPE)  # where the signal cannot end the process
