"""Run a sweep: every run of a grid, on local worker processes or as Ray tasks (its executor).

The results table `results.parquet` (one row per run: config fields, accuracies, steps, wall
time, checkpoint path, status, error) is rebuilt from the run folders and written atomically
after every finished run, so a killed sweep loses no finished row and never duplicates one.
Rerunning the sweep skips finished runs and resumes unfinished ones from their checkpoints.
A failing run is recorded (status "failed", with its error) without stopping the others;
`retries` reruns it that many more times.

With `stack=True`, runs that differ only in seed and optimiser settings (mecheval.train.loop.
stack_key) train together as stacked models, up to `stack_memory` bytes of
estimated training memory per stack; each still gets its own folder, result row and error.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from mecheval.checks import check_int
from mecheval.config import ConfigError, flatten, from_dict, to_dict
from mecheval.io import DamagedFileError, atomic_write_parquet
from mecheval.run_folder import files
from mecheval.run_folder.files import RESULT, read_result
from mecheval.sweep.executor import EXECUTORS, Executor
from mecheval.sweep.grid import Run
from mecheval.train.config import TrainConfig, identity
from mecheval.train.loop import stack_key, train, train_stacked, training_bytes

RESULTS = "results.parquet"
STACK_MEMORY = 4 << 30  # bytes of estimated training memory per stack


def _outcome(run_path: Path, result: dict | BaseException) -> dict[str, Any]:
    if isinstance(result, BaseException):
        record = {
            "status": "failed",
            "error": f"{type(result).__name__}: {result}",
            "traceback": "".join(traceback.format_exception(result)),
        }
        files.write_error(run_path, record)
        return record
    files.clear_error(run_path)
    return {"status": "finished", **result}


def run_one(config_dict: dict, run_dir: str, threads: int | None = None) -> dict[str, Any]:
    """Train one run (in a worker); returns its result, or its error, never raises."""
    if threads:
        torch.set_num_threads(threads)
    config = from_dict(TrainConfig, config_dict)
    try:
        result: dict | BaseException = train(config, Path(run_dir))
    except Exception as error:  # recorded, so that one bad run does not stop the sweep
        result = error
    return _outcome(Path(run_dir), result)


def run_stack(
    config_dicts: list[dict], run_dirs: list[str], threads: int | None = None
) -> list[dict[str, Any]]:
    """Train runs as one stack (in a worker); returns each run's result or error, never
    raises. When the stack as a whole fails (a run's folder holds another config, a file is
    damaged), each run is trained alone instead, so that one bad folder fails only its run."""
    if len(config_dicts) == 1:
        return [run_one(config_dicts[0], run_dirs[0], threads)]
    if threads:
        torch.set_num_threads(threads)
    paths = [Path(d) for d in run_dirs]
    try:
        configs = [from_dict(TrainConfig, c) for c in config_dicts]
        results = train_stacked(configs, paths)
    except Exception:
        return [run_one(c, d) for c, d in zip(config_dicts, run_dirs, strict=True)]
    return [_outcome(p, r) for p, r in zip(paths, results, strict=True)]


def stacks(runs: list[Run], memory: int) -> list[list[Run]]:
    """`runs` in groups that train as one stack: same `stack_key`, in the runs' order, each
    group within `memory` bytes of estimated training memory (at least one run)."""
    groups: dict[str, list[list[Run]]] = {}
    for run in runs:
        chunks = groups.setdefault(stack_key(run.config), [[]])
        if chunks[-1] and training_bytes(run.config) * (len(chunks[-1]) + 1) > memory:
            chunks.append([])
        chunks[-1].append(run)
    return [chunk for chunks in groups.values() for chunk in chunks]


def result_row(run: Run, run_dir: Path) -> dict[str, Any]:
    """The table row of one run, read from its folder (pending, finished or failed)."""
    row: dict[str, Any] = {"run": run.name}
    for key, value in flatten(identity(run.config)).items():
        row[key] = json.dumps(value) if isinstance(value, (list, dict)) else value
    if (run_dir / RESULT).exists():
        try:
            result = read_result(run_dir)
        except DamagedFileError as error:  # recorded by name; the other rows go on
            row.update(status="failed", error=f"{type(error).__name__}: {error}")
            return row
        row.update(
            status="finished",
            dev_accuracy=result["dev_accuracy"],
            test_accuracy=result["test_accuracy"],
            best_accuracy=result["best_accuracy"],
            steps=result["steps"],
            wall_time_s=result["wall_time_s"],
            num_params=result["num_params"],
            checkpoint=result["checkpoint"],
            error=None,
        )
    elif (run_dir / files.ERROR).exists():
        try:
            error = files.read_error(run_dir)
        except DamagedFileError as unreadable:
            error = str(unreadable)
        row.update(status="failed", error=error)
    else:
        row.update(status="pending", error=None)
    return row


def write_results(runs: list[Run], out: Path) -> pd.DataFrame:
    frame = pd.DataFrame([result_row(run, out / run.name) for run in runs])
    atomic_write_parquet(out / RESULTS, frame)
    return frame


def _kill_with_parent() -> None:
    """Worker initialiser (Linux): die when the sweep process dies, so a killed sweep leaves no
    orphan still training a run that the resumed sweep would train too."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _arguments(group: list[Run], out: Path) -> tuple[list[dict], list[str]]:
    return [to_dict(r.config) for r in group], [str((out / r.name).resolve()) for r in group]


def _run_local(groups: list[list[Run]], out: Path, workers: int, on_done: Callable) -> None:
    if workers == 1:
        for group in groups:
            for run, outcome in zip(group, run_stack(*_arguments(group, out)), strict=True):
                on_done(run, outcome)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // workers)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_kill_with_parent) as pool:
        futures = {
            pool.submit(run_stack, *_arguments(group, out), threads): group for group in groups
        }
        for future in as_completed(futures):
            for run, outcome in zip(futures[future], future.result(), strict=True):
                on_done(run, outcome)


def _run_ray(
    groups: list[list[Run]], out: Path, workers: int, on_done: Callable, address: str | None
) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address,
            num_cpus=None if address else workers,
            include_dashboard=False,
            log_to_driver=False,
        )
    use_gpu = bool(ray.cluster_resources().get("GPU"))
    remote = ray.remote(num_cpus=1, num_gpus=1 if use_gpu else 0, max_retries=0)(run_stack)
    refs = {remote.remote(*_arguments(group, out), 1): group for group in groups}
    waiting = list(refs)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1)
        for run, outcome in zip(refs[done[0]], ray.get(done[0]), strict=True):
            on_done(run, outcome)


def run_sweep(
    runs: list[Run],
    out: str | Path,
    executor: Executor = "local",
    workers: int = 1,
    retries: int = 0,
    address: str | None = None,
    progress: bool = True,
    stack: bool = False,
    stack_memory: int = STACK_MEMORY,
) -> pd.DataFrame:
    """Run every unfinished run of `runs` under `out` on `executor` (runs that stack as
    stacks, with `stack`); returns the results table."""
    if executor not in EXECUTORS:
        raise ConfigError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    try:
        check_int("workers", workers, 1)
        check_int("retries", retries, 0)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [Run(r.name, r.config.replace(progress=progress and workers == 1)) for r in runs]
    write_results(runs, out)
    from tqdm.auto import tqdm

    for attempt in range(retries + 1):
        pending = [r for r in runs if not (out / r.name / RESULT).exists()]
        if not pending:
            break
        bar = tqdm(
            total=len(pending),
            desc=f"sweep (attempt {attempt + 1})",
            unit="run",
            disable=not progress,
        )

        def on_done(run: Run, outcome: dict, bar=bar) -> None:
            write_results(runs, out)
            bar.update(1)
            bar.set_postfix(last=f"{run.name}: {outcome['status']}")

        groups = stacks(pending, stack_memory) if stack else [[run] for run in pending]
        if executor == "local":
            _run_local(groups, out, workers, on_done)
        else:
            _run_ray(groups, out, workers, on_done, address)
        bar.close()
    return write_results(runs, out)
