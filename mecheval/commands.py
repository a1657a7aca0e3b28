"""What each `mecheval` subcommand does (mecheval.cli parses their arguments): each loads its
config, calls the library and prints what it made. Every command imports what it runs when it
runs, so that `--help` or a bad option answers without loading torch."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from mecheval.config import ConfigError
from mecheval.evaluation.config import DasOptions, EvaluateConfig, OptionError


def folder(path: Path, option: str = "--out") -> Path:
    """`path`, refused by name when it, or a folder it would be made in, is a file."""
    for above in [path, *path.parents]:
        if above.exists():
            if not above.is_dir():
                where = "is a file" if above == path else f"lies under {above}, which is a file"
                raise ConfigError(f"{option}: {path} {where}; give a folder")
            break
    return path


def check_cache() -> None:
    """Refuse a dataset cache that cannot be written (MECHEVAL_CACHE naming a file) before any
    run starts."""
    from mecheval.tasks.dataset_cache import default_cache_dir

    default_cache_dir()


def train(args: argparse.Namespace) -> int:
    from mecheval.sweep import run_name
    from mecheval.train.config import load_train_config
    from mecheval.train.loop import train

    config = load_train_config(args.config, args.overrides)
    out = folder(Path(args.out) if args.out else Path("runs") / run_name(config))
    check_cache()
    result = train(config, out)
    dev, test = result["dev_accuracy"], result["test_accuracy"]
    print(f"{out}: dev accuracy {dev:.4f}, test accuracy {test:.4f}")
    return 0


def _on_gpu(device: str) -> bool:
    from mecheval.train.config import resolve_device

    return resolve_device(device).type == "cuda"


def sweep(args: argparse.Namespace) -> int:
    from mecheval.sweep import (
        EXECUTORS,
        estimate_sweep,
        execution_of,
        load_sweep,
        run_sweep,
        select_runs,
    )

    if args.executor not in EXECUTORS:
        raise ConfigError(f"--executor must be one of {EXECUTORS}, got {args.executor!r}")
    runs = load_sweep(args.file, args.overrides)
    if args.only:
        runs = select_runs(runs, args.only)
        if not runs:
            raise ConfigError(f"--only {' '.join(args.only)} matches no run of {args.file}")
    out = folder(Path(args.out) if args.out else Path("runs") / Path(args.file).stem)
    check_cache()
    if args.dry_run:
        print(
            f"{len(runs)} runs in {args.file}; measuring a few steps of each distinct model",
            flush=True,
        )
        estimate = estimate_sweep(runs, workers=args.workers, progress=True, stack=args.stack)
        for row in estimate["per_run"]:
            ms, minutes = row["step_s"] * 1e3, row["estimate_s"] / 60
            print(f"{row['run']:60s} {row['steps']:8d} steps x {ms:8.2f} ms = {minutes:8.1f} min")
        hours = estimate["estimated_wall_s"] / 3600
        runs_n = estimate["runs"]
        print(f"{runs_n} runs; estimated wall time {hours:.2f} h on {args.workers} worker(s)")
        if any(_on_gpu(run.config.device) for run in runs):
            gpu_hours = estimate["total_run_s"] / 3600
            print(f"estimated GPU-hours: {gpu_hours:.2f} (from the step times measured here)")
        return 0
    table = run_sweep(runs, out, **execution_of(args))
    counts = table["status"].value_counts().to_dict()
    print(f"{out / 'results.parquet'}: {counts}")
    return 0 if counts.get("failed", 0) == 0 else 1


def data_stats(args: argparse.Namespace) -> int:
    from mecheval.config import parse_overrides
    from mecheval.tasks import make_task, stats_table

    # `--task atr max_rhs_len=5`: nargs="+" also takes the overrides that follow the names.
    names = [item for item in args.task if "=" not in item]
    overrides = [item for item in args.task if "=" in item] + list(args.overrides)
    if not names:
        raise ConfigError(f"--task takes task names or import paths, got {args.task}")
    options = parse_overrides(overrides)
    try:
        tasks = [make_task(name, **options) for name in names]
    except (TypeError, ValueError) as error:  # a task option (named by the task)
        raise ConfigError(str(error)) from None
    check_cache()
    print(stats_table(tasks, n=args.n, seed=args.seed, grammar_seeds=args.grammar_seeds))
    return 0


def flag(option: str) -> str:
    """An EvaluateConfig field as `mecheval evaluate` names it (memory_budget: --memory-budget)."""
    return "--" + option.replace("_", "-")


def _over_runs(job, options_class, args: argparse.Namespace):
    """`job(path, force=..., **options)` over the run folders at args.path, its options the
    fields of `options_class` as parsed; an option's error names it as the command line does."""
    check_cache()
    options = {field.name: getattr(args, field.name) for field in fields(options_class)}
    try:
        return job(args.path, force=args.force, allow_code_change=args.allow_code_change, **options)
    except OptionError as error:
        raise error.renamed(flag) from None


def evaluate(args: argparse.Namespace) -> int:
    from mecheval.config import parse_overrides
    from mecheval.evaluation.evaluate import evaluate_all, evaluation_summary
    from mecheval.evaluation.kinds import evaluate_kind
    from mecheval.run_folder.status import finished_runs

    if args.kind == "grid" and args.option:
        raise ConfigError("--option: the grid takes its options as flags (--positions, ...)")
    if args.kind != "grid":
        kind_options = parse_overrides(args.option)
        job = lambda path, **kw: evaluate_kind(path, args.kind, kind_options, **kw)  # noqa: E731
        table = _over_runs(job, EvaluateConfig, args)
        print(f"{args.kind} on {table['run'].nunique()} run(s): {len(table)} rows")
        return 0
    table = _over_runs(evaluate_all, EvaluateConfig, args)
    for run in finished_runs(args.path):
        print(evaluation_summary(run))
    print(f"evaluated {table['run'].nunique()} run(s): {len(table)} cells x examples")
    return 0


def das(args: argparse.Namespace) -> int:
    from mecheval.evaluation.das_runs import das_all, left_out_of
    from mecheval.run_folder.status import finished_runs

    table = _over_runs(das_all, DasOptions, args)
    held = table.groupby(["run", "corruption", "layer", "site", "position", "k"]).size()
    print(
        f"DAS on {table['run'].nunique()} run(s): {len(held)} (site, position, k) "
        f"combinations x {int(held.max())} held-out documents; IIA by k in each run's "
        "das.parquet, the learned bases in its das_bases.safetensors"
    )
    for run in finished_runs(args.path):
        for site, ks in left_out_of(run).items():
            print(f"{run.name}: k {', '.join(map(str, ks))} left out at {site} (its width is less)")
    return 0


def report(args: argparse.Namespace) -> int:
    from mecheval.evaluation.report import build_report

    out = build_report(
        args.path,
        folder(Path(args.out)) if args.out else None,
        allow_code_change=args.allow_code_change,
    )
    print(f"{out / 'report.md'}\n{out / 'report.html'}")
    return 0


def run(args: argparse.Namespace) -> int:
    import time

    from mecheval.pipeline import load_run_config, run_pipeline, summary

    start = time.time()
    if args.config and "=" in args.config:  # `mecheval run workers=4`: an override, no file
        args.overrides, args.config = [args.config, *args.overrides], None
    config = load_run_config(args.config, args.overrides)
    check_cache()
    done = run_pipeline(config, folder(Path(args.out)))
    print(summary(done["mechanisms"], done["findings"]))
    print(f"report: {done['report'] / 'report.md'} ({time.time() - start:.0f} s)")
    return 0 if (done["results"]["status"] == "finished").all() else 1


def _evaluate_pretrained(args: argparse.Namespace) -> int:
    from mecheval.evaluation.evaluate import evaluation_summary
    from mecheval.evaluation.pretrained import evaluate_pretrained
    from mecheval.run_folder.files import read_result

    if args.path is not None or args.task is None or args.out is None:
        raise ConfigError("--model takes --task FILE and --out DIR, and no run folder")
    if getattr(args, "kind", "grid") != "grid":
        raise ConfigError("--model runs the interchange grid alone (no --kind)")
    options = {field.name: getattr(args, field.name) for field in fields(EvaluateConfig)}
    try:
        table = evaluate_pretrained(
            args.model, args.task, folder(Path(args.out)), eval_size=args.eval_size,
            dtype=args.dtype, force=args.force, **options,
        )  # fmt: skip
    except OptionError as error:
        raise error.renamed(flag) from None
    result = read_result(args.out)
    model = result["config"]["model"]
    print(
        f"{args.out}: {args.model} ({model['arch']}, {model['n_layers']} layers, "
        f"{result['num_params']:,} parameters): dev accuracy {result['dev_accuracy']:.4f}, "
        f"test accuracy {result['test_accuracy']:.4f}"
    )
    print(evaluation_summary(args.out))
    print(f"evaluated 1 pretrained model: {len(table)} cells x examples")
    return 0


def evaluate_or_pretrained(args: argparse.Namespace) -> int:
    """`mecheval evaluate`: of run folders, or, with --model, of a pretrained checkpoint."""
    if args.model is None:
        if args.path is None:
            raise ConfigError("evaluate takes a run or sweep folder (or --model, --task, --out)")
        return args.evaluate(args)
    return _evaluate_pretrained(args)
