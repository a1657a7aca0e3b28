"""The `mecheval` command line: its arguments (here) and its commands (mecheval.commands), which
load configs and call the library: everything can be done from Python too.

    mecheval [--debug] COMMAND ...
    mecheval train [--config FILE] [--out DIR] [key=value ...]
    mecheval sweep FILE [--out DIR] [--executor local|ray] [--workers N] [--retries N]
                        [--address ADDR] [--dry-run] [--stack] [--only key=value ...]
                        [key=value ...]
    mecheval data stats [--task NAME ...] [--n N] [--grammar-seeds K] [key=value ...]
    mecheval evaluate RUN_DIR|SWEEP_DIR [--device cpu] [--split dev] [--positions ...]
                      [--corruptions ...] [--seed N] [--memory-budget BYTES]
                      [--step N|latest] [--force] [--allow-code-change]
    mecheval evaluate --model hf:FOLDER|HUB_ID --task FILE --out DIR [--eval-size N]
                      [--dtype float32] [the options above but --step]
    mecheval das RUN_DIR|SWEEP_DIR [--sites ...] [--layers ...] [--positions ...] [--dims ...]
                 [--corruptions ...] [--steps N] [--lr X] [--batch-size N] [--holdout X]
                 [--seed N] [--split dev] [--device cpu] [--step N|latest] [--force]
                 [--allow-code-change]
    mecheval report DIR [--out DIR] [--allow-code-change]
    mecheval run [CONFIG] [--out DIR] [key=value ...]

Every error the user can fix (a bad option or config, a missing or damaged file, a folder in
use by another process, a run that diverged) ends the command with one line on stderr naming
it, and exit status 2 (a bad option or config) or 1 (anything else). Anything else is a bug:
one line saying so, exit status 3, and its traceback with `--debug`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

# Only these light modules load at start; each command (mecheval.commands) imports what it runs
# when it runs, so that `--help` or a bad option answers without loading torch.
from mecheval import commands
from mecheval.config import ConfigError
from mecheval.evaluation.config import DasOptions, EvaluateConfig
from mecheval.run_folder import LATEST


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one `--help` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(minimum: int):
    """An argparse type: an int >= minimum (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


class _Deprecated(argparse.Action):
    """An old name of an option: stores into the new one, with a warning naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(f"mecheval: {option_string} is deprecated, use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _step(text: str) -> int | str:
    """An argparse type: a checkpoint step number, or "latest" (checked by the library)."""
    if text == LATEST:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a step number or {LATEST!r}, got {text!r}"
        ) from None


def _command(sub, name: str, help: str, func) -> argparse.ArgumentParser:
    """The subcommand `name`'s parser, which runs `func(args)`."""
    p = sub.add_parser(name, help=help)
    p.set_defaults(func=func)
    return p


def _run_options(
    sub, name: str, help: str, func, options: type, flags: dict[str, dict]
) -> argparse.ArgumentParser:
    """A subcommand over run or sweep folders that takes one flag per field of the `options`
    dataclass (its default the field's, the rest of its argparse keywords in `flags`)."""
    p = _command(sub, name, help, func)
    # (`mecheval evaluate --model ... --out DIR` names no run folder: _add_pretrained)
    p.add_argument(
        "path", nargs="?" if name == "evaluate" else None, help="a run folder or a sweep folder"
    )
    defaults = options()
    for field in fields(options):
        p.add_argument(
            commands.flag(field.name), default=getattr(defaults, field.name), **flags[field.name]
        )
    p.add_argument("--force", action="store_true", help="redo runs already done")
    _allow_code_change(p)
    return p


def _allow_code_change(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-code-change",
        action="store_true",
        help="go on with runs whose architecture's code changed since they were trained",
    )


def _add_train(sub) -> None:
    p = _command(sub, "train", "train one model", commands.train)
    p.add_argument("--config", help="YAML training config")
    p.add_argument("--out", help="run folder (default: runs/<name from config>)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. arch=mamba lr=1e-3")


def _add_sweep(sub) -> None:
    p = _command(sub, "sweep", "train a grid of models", commands.sweep)
    p.add_argument("file", help="YAML sweep file (base + grid)")
    p.add_argument("--out", help="sweep folder (default: runs/<file stem>)")
    p.add_argument(
        "--executor",
        default="local",
        help="where the runs execute: local (worker processes, the default) or ray",
    )
    p.add_argument(  # the flag's name before --executor
        "--backend", dest="executor", action=_Deprecated, help=argparse.SUPPRESS
    )
    p.add_argument("--workers", type=_count(1), default=1)
    p.add_argument(
        "--retries", type=_count(0), default=0, help="rerun failed runs this many more times"
    )
    p.add_argument("--address", help="Ray cluster address (default: start a local cluster)")
    p.add_argument("--dry-run", action="store_true", help="print grid size and estimated time")
    p.add_argument(
        "--stack",
        action="store_true",
        help="train runs that differ only in seed and optimiser settings as stacked models",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run only the grid rows matching this (repeatable; VALUE may be a,b)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the sweep's base config")


def _add_data(sub) -> None:
    data = sub.add_parser("data", help="task data tools").add_subparsers(
        dest="data_command", required=True
    )
    p = _command(data, "stats", "document length and distance statistics", commands.data_stats)
    p.add_argument(
        "--task", nargs="+", default=["ar"], help="task names or import paths (ar, atr, mqar, ...)"
    )
    p.add_argument("--n", type=int, default=2000, help="documents sampled per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--grammar-seeds",
        type=int,
        default=8,
        help="ATR: also show the mean and spread of per-grammar means over this many grammar "
        "seeds, from the task's seed on (0: off)",
    )
    p.add_argument("overrides", nargs="*", help="task options as key=value")


# How `mecheval evaluate` takes each EvaluateConfig field: its flag is `commands.flag(field)`, its
# default the field's; these are the rest of its argparse keywords.
_EVALUATE_FLAGS: dict[str, dict] = {
    "split": {"help": "dev or test"},
    "corruptions": {"nargs": "+", "help": "e.g. key value"},
    "positions": {"nargs": "+", "help": "e.g. key query value+1"},
    "device": {},
    "seed": {"type": int, "help": "the corruption's seed"},
    "memory_budget": {"type": int, "help": "bytes per chunk"},
    "step": {
        "type": _step,
        "help": "the checkpoint to evaluate: a step number, or latest (the newest intact one); "
        "default: the one the run's result.json names",
    },
}


def _add_evaluate(sub) -> None:
    help = "run the intervention grids (or another kind of intervention) of trained runs"
    p = _run_options(sub, "evaluate", help, commands.evaluate, EvaluateConfig, _EVALUATE_FLAGS)
    p.add_argument(
        "--kind",
        default="grid",
        help="the intervention kind: grid (the default), mean_ablation, resample_ablation, "
        "path, eap, eap_ig, or an import path (docs/interventions.md)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the kind (repeatable), e.g. layers=[0,1]",
    )


def _int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("1,2,4")."""
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names ("key,value")."""
    return [part for part in text.split(",") if part]


# How `mecheval das` takes each DasOptions field (its flag `commands.flag(field)`, its default the
# field's): the rest of its argparse keywords.
_DAS_FLAGS: dict[str, dict] = {
    "sites": {
        "type": _name_list,
        "help": "e.g. block_input,state, each of which every run's model must have (default: "
        "those of block_input, mixer_output, conv_output, state each model has)",
    },
    "layers": {"type": _int_list, "help": "e.g. 0,1 (default: every layer)"},
    "positions": {"type": _name_list, "help": "e.g. key,value,query"},
    "dims": {
        "type": _int_list,
        "help": "subspace sizes, e.g. 1,2,4,8 (full width added; default: 1,2,4,...,32 below "
        "the widest site's width)",
    },
    "corruptions": {"type": _name_list, "help": "key and/or value"},
    "steps": {"type": int, "help": "optimiser steps"},
    "lr": {"type": float, "help": "Adam's learning rate"},
    "batch_size": {"type": int, "help": "training documents per step"},
    "holdout": {"type": float, "help": "share of the documents held out for IIA"},
    "seed": {"type": int, "help": "the corruption's and the training's seed"},
    "split": {"help": "dev or test"},
    "device": {},
    "step": {"type": _step, "help": "the checkpoint: a step number, or latest"},
}


def _add_das(sub) -> None:
    help = "distributed alignment search: in how many dimensions the answer lives"
    _run_options(sub, "das", help, commands.das, DasOptions, _DAS_FLAGS)


def _add_report(sub) -> None:
    p = _command(sub, "report", "write the Markdown/HTML report of evaluated runs", commands.report)
    p.add_argument("path", help="a run folder or a sweep folder")
    p.add_argument("--out", help="report folder (default: PATH/report)")
    _allow_code_change(p)


def _add_run(sub) -> None:
    p = _command(sub, "run", "the main job: train, evaluate, report", commands.run)
    p.add_argument("config", nargs="?", help="YAML run config (default: the CPU quickstart)")
    p.add_argument("--out", default="runs/main", help="output folder")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. workers=4")


def _add_pretrained(p: argparse.ArgumentParser) -> None:
    """`mecheval evaluate`'s flags for a pretrained checkpoint (docs/pretrained.md)."""
    p.set_defaults(evaluate=p.get_default("func"), func=commands.evaluate_or_pretrained)
    p.add_argument("--model", help="a pretrained checkpoint: hf:FOLDER or hf:HUB_ID")
    p.add_argument("--task", help="with --model: a YAML file of the prompts task's options")
    p.add_argument("--out", help="with --model: the run folder to write")
    p.add_argument(
        "--eval-size", type=_count(1), default=None, help="with --model: documents per split"
    )
    p.add_argument("--dtype", default="float32", help="with --model: float32, bfloat16, float16")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mecheval", description="Mechanistic evaluation of sequence models.")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of any error, not one line"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_sweep, _add_data, _add_evaluate, _add_das, _add_report, _add_run):
        add(sub)
    _add_pretrained(sub.choices["evaluate"])
    return parser


def _os_error(error: OSError) -> str:
    if error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def _message(error: BaseException) -> tuple[str, int]:
    """The line that reports `error`, and the exit status (see the module docstring)."""
    from mecheval.io import DamagedFileError, FolderInUseError
    from mecheval.models.registry import UserCodeError
    from mecheval.run_folder.provenance import CodeChangedError as CodeChanged
    from mecheval.train.loop import TrainingDiverged

    if isinstance(error, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(error, UserCodeError):
        return f"error in the architecture's code: {error}", 2
    if isinstance(error, ConfigError):
        return f"config error: {error}", 2
    if isinstance(error, (DamagedFileError, TrainingDiverged, FolderInUseError, CodeChanged)):
        return f"error: {error}", 1
    if isinstance(error, OSError):  # a file or folder the command cannot use
        return f"error: {_os_error(error)}", 1
    return (
        f"internal error (a bug; please report it): {type(error).__name__}: {error}. "
        "Run again with --debug for its traceback.",
        3,
    )


def _note(message, category, filename, lineno, line=None) -> str:
    """A warning as one line on stderr (its source's location is the library's, no help)."""
    return f"mecheval: note: {' '.join(str(message).split())}\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    formatted, warnings.formatwarning = warnings.formatwarning, _note
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as error:
        if args.debug:
            raise
        message, status = _message(error)
        # One line: messages that quote a parser's (YAML's) several lines are joined.
        print("mecheval: " + " ".join(message.split()), file=sys.stderr)
        return status
    finally:
        warnings.formatwarning = formatted


if __name__ == "__main__":
    raise SystemExit(main())
