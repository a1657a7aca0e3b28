"""Pretrained models under the grid, measured side by side in one process on one thread:

speed   the interchange grid on our model of a random Hugging Face checkpoint, beside pyvene's
        interchange interventions and a plain hook loop on the Hugging Face model itself, and
        mecheval's per-cell loop on ours, for the block sites pyvene reaches (every layer, block
        input/output, mixer input/output, MLP input/output) at the named positions or at all;
        process CPU seconds, each method's p_restored checked equal to the grid's.
parity  the largest |logit difference| between ours and theirs per family (transformers' own
        forward; fla's models with their layers' naive recurrences, fla's own needing CUDA).
memory  the grid's peak resident memory above the loaded model, on a GPT-2-small-sized model
        (d_model 768, 12 layers, 12 heads, vocabulary 50,257, random weights), at two memory
        budgets, each in a fresh process (a sampling thread reads /proc/self/statm every 2 ms);
        with --split, in the calls of documents_per_call documents `mecheval evaluate --model`
        makes; the plan's accounting (mecheval.interventions.plan.GridMemory) beside it.

Run: python -m benchmarks.bench_pretrained speed [--families gpt2,mamba] [--sizes tiny,small]
         [--grids named,all] [--json FILE]
     python -m benchmarks.bench_pretrained parity
     python -m benchmarks.bench_pretrained memory [--budgets 128M,1G] [--docs 8] [--length 32]
         [--split]
     pytest benchmarks/bench_pretrained.py --benchmark-only   (tiny, named: pytest-benchmark)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mecheval.interventions import interchange_grid, per_cell_loop
from mecheval.interventions.positions import NAMED, expand_positions, resolve_position
from mecheval.models.pretrained import FAMILIES, from_pretrained, hf_site
from mecheval.models.pretrained.hf_sites import BLOCK_SITES
from mecheval.models.pretrained.synthetic import random_batch, random_hf_model

SIZES = {
    "tiny": {"d_model": 64, "n_layers": 2, "vocab_size": 1024},
    "small": {"d_model": 256, "n_layers": 4, "vocab_size": 8192},
}
GRIDS = {"named": None, "all": ["all"]}
DOCS, LENGTH = 32, 32
# fla's own layers run Triton kernels alone (CUDA): on CPU there is no Hugging Face forward of
# theirs to hook, so pyvene and the hook loop are not measured for them.
HF_ON_CPU = ("gpt2", "llama", "mamba", "mamba2")


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _replace_first(value, new):
    return (new, *value[1:]) if isinstance(value, tuple) else new


@contextlib.contextmanager
def _hook(module, where: str, fn):
    """fn(tensor) -> tensor or None, on the module's input (first argument) or output."""
    if where == "input":

        def pre(m, args, kwargs):
            if args:
                new = fn(args[0])
                return None if new is None else ((new, *args[1:]), kwargs)
            key = next(iter(kwargs))
            new = fn(kwargs[key])
            return None if new is None else (args, {**kwargs, key: new})

        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    else:

        def post(m, inputs, out):
            new = fn(_first(out))
            return None if new is None else _replace_first(out, new)

        handle = module.register_forward_hook(post)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def hook_loop(hf, family, batch, corrupted, layers, sites, labels) -> dict:
    """(layer, site, label) -> p_restored (n,): one forward of the corrupted documents per
    cell, the clean activation put in by a plain forward hook on the Hugging Face module."""
    rows, query, answers = torch.arange(len(batch)), batch.positions["query"], batch.answers
    out = {}
    for layer in layers:
        for site in sites:
            path, where = hf_site(family, layer, site)
            module, seen = hf.get_submodule(path), []
            with _hook(module, where, seen.append):
                hf(batch.tokens, use_cache=False)
            clean_values = seen[0].clone()
            for label in labels:
                at = resolve_position(label, batch)

                def patch(x, at=at, clean_values=clean_values):
                    x = x.clone()
                    x[rows, at] = clean_values[rows, at]
                    return x

                with _hook(module, where, patch):
                    logits = hf(corrupted, use_cache=False).logits[rows, query]
                out[layer, site, label] = F.softmax(logits.float(), -1)[rows, answers]
    return out


@torch.no_grad()
def pyvene_loop(hf, family, batch, corrupted, layers, sites, labels) -> dict:
    """(layer, site, label) -> p_restored (n,): pyvene's vanilla interchange intervention, one
    IntervenableModel per (layer, site), one call per position label (all documents at once)."""
    import pyvene as pv
    from pyvene.models.constants import CONST_INPUT_HOOK, CONST_OUTPUT_HOOK
    from pyvene.models.intervenable_modelcard import (
        type_to_dimension_mapping,
        type_to_module_mapping,
    )

    hooks = {"input": CONST_INPUT_HOOK, "output": CONST_OUTPUT_HOOK}
    mapping = {}
    for site in sites:  # module paths by layer, as pyvene's own model cards write them
        path, where = hf_site(family, 12345, site)
        mapping[site] = (path.replace(".12345", "[%s]", 1), hooks[where])
    type_to_module_mapping[type(hf)] = mapping
    type_to_dimension_mapping[type(hf)] = {site: ("hidden_size",) for site in sites}
    rows, query, answers = torch.arange(len(batch)), batch.positions["query"], batch.answers
    out = {}
    for layer in layers:
        for site in sites:
            config = {
                "layer": layer,
                "component": site,
                "intervention_type": pv.VanillaIntervention,
            }
            model = pv.IntervenableModel(config, model=hf)
            for label in labels:
                where = [[[int(p)] for p in resolve_position(label, batch)]]
                _, patched = model(
                    base={"input_ids": corrupted, "use_cache": False},
                    sources=[{"input_ids": batch.tokens, "use_cache": False}],
                    unit_locations={"sources->base": (where, where)},
                )
                logits = patched.logits[rows, query].float()
                out[layer, site, label] = F.softmax(logits, -1)[rows, answers]
    return out


def _seconds(fn) -> tuple[float, object]:
    """(process CPU seconds of fn(), its result): on one thread, its wall-clock time without
    the other jobs that share the machine."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def _grid_cells(grid) -> dict:
    """(layer, site, label) -> p_restored (n,) of a grid's frame."""
    out = {}
    for (layer, site, label), part in grid.groupby(["layer", "site", "position"], sort=False):
        out[layer, site, label] = torch.tensor(part.sort_values("example").p_restored.to_numpy())
    return out


def _same(ours: dict, theirs: dict, method: str) -> None:
    for key, p in theirs.items():
        np.testing.assert_allclose(
            p.numpy(), ours[key].numpy(), atol=2e-5, rtol=1e-3, err_msg=f"{method} {key}"
        )


def setup(family: str, size: str):
    """(Hugging Face model, ours, documents, corruption, block sites, layers) of one size."""
    hf = random_hf_model(family, **SIZES[size], seed=0)
    model = from_pretrained(hf)
    batch, corrupted = random_batch(SIZES[size]["vocab_size"], n=DOCS, length=LENGTH, seed=0)
    sites = [s for s in BLOCK_SITES if f"layers.0.{s}" in model.site_names()]
    return hf, model, batch, corrupted, sites, list(range(model.config.n_layers))


def measure(family: str, size: str, grid: str, repeats: int) -> dict:
    """Seconds of each method on one (family, size, grid), the results checked equal."""
    hf, model, batch, corrupted, sites, layers = setup(family, size)
    labels = expand_positions(GRIDS[grid], LENGTH)
    args = (model, batch, corrupted)
    run_grid = lambda: interchange_grid(*args, sites=sites, positions=GRIDS[grid])  # noqa: E731
    run_grid()  # warm-up
    ours, table = min((_seconds(run_grid) for _ in range(repeats)), key=lambda t: t[0])
    cells = _grid_cells(table)
    row = {"family": family, "size": size, "grid": grid, "cells": len(cells), "grid_s": ours}
    loop_s, loop = _seconds(lambda: per_cell_loop(*args, sites=sites, positions=GRIDS[grid]))
    _same(cells, _grid_cells(loop), "per_cell_loop")
    row["per_cell_loop_s"] = loop_s
    if family in HF_ON_CPU:
        for name, fn in (("hook_loop", hook_loop), ("pyvene", pyvene_loop)):
            seconds, theirs = _seconds(
                lambda fn=fn: fn(hf, family, batch, corrupted, layers, sites, labels)
            )
            _same(cells, theirs, name)
            row[f"{name}_s"] = seconds
    return row


@pytest.mark.parametrize("method", ["grid", "hook loop", "pyvene"])
@pytest.mark.parametrize("family", HF_ON_CPU)
def test_grid_beside_pyvene(benchmark, family, method):
    """The same on the tiny size at the named positions, as pytest-benchmark figures."""
    torch.set_num_threads(1)
    hf, model, batch, corrupted, sites, layers = setup(family, "tiny")
    runs = {
        "grid": lambda: interchange_grid(model, batch, corrupted, sites=sites),
        "hook loop": lambda: hook_loop(hf, family, batch, corrupted, layers, sites, NAMED),
        "pyvene": lambda: pyvene_loop(hf, family, batch, corrupted, layers, sites, NAMED),
    }
    benchmark.group = f"pretrained {family} tiny, {DOCS} docs of {LENGTH}, block sites, named"
    benchmark.pedantic(runs[method], rounds=1 if method != "grid" else 3, warmup_rounds=1)


def _table(rows: list[dict]) -> str:
    head = "| family | size | grid | cells | grid s | pyvene s | hook loop s | per-cell loop s "
    head += "| vs pyvene | vs hook loop | vs per-cell loop |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:

        def ratio(key, r=r):
            return f"{r[key] / r['grid_s']:.1f}x" if key in r else "n/a"

        def secs(key, r=r):
            return f"{r[key]:.2f}" if key in r else "n/a"

        lines.append(
            f"| {r['family']} | {r['size']} | {r['grid']} | {r['cells']} | {r['grid_s']:.2f} "
            f"| {secs('pyvene_s')} | {secs('hook_loop_s')} | {secs('per_cell_loop_s')} "
            f"| {ratio('pyvene_s')} | {ratio('hook_loop_s')} | {ratio('per_cell_loop_s')} |"
        )
    return "\n".join(lines)


@torch.no_grad()
def parity() -> list[dict]:
    """The largest |logit difference| per family on its default random tiny configuration (3
    sequences of 24 tokens), and the largest logit beside it."""
    rows = []
    for family in FAMILIES:
        hf = random_hf_model(family)
        model = from_pretrained(hf)
        tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
        if family in HF_ON_CPU:
            theirs = hf(tokens, use_cache=False).logits
        else:
            theirs = _fla_naive_logits(hf, tokens)
        gap = float((model(tokens) - theirs).abs().max())
        rows.append({"family": family, "max_abs_diff": gap, "max_logit": float(theirs.abs().max())})
    return rows


def _fla_naive_logits(hf, tokens):
    sys.path.insert(0, os.getcwd())  # the tests' oracle: fla's model with naive layer forwards
    from tests.models.pretrained.fla_reference import fla_logits

    return fla_logits(hf, tokens)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_one(budget: int, docs: int, length: int, split: bool = False) -> dict:
    """The grid's peak resident memory above the loaded model, at one budget (this process):
    one interchange_grid call on every document, or (`split`) the calls of as many documents
    as `documents_per_call` allows, as `mecheval evaluate --model` makes them."""
    from mecheval.evaluation.pretrained import grids
    from mecheval.interventions.plan import documents_per_call, plan_grid

    hf = random_hf_model("gpt2", d_model=768, n_layers=12, vocab_size=50257, n_head=12)
    model = from_pretrained(hf)
    del hf
    batch, corrupted = random_batch(50257, n=docs, length=length, seed=0)
    plan = plan_grid(model, batch, corrupted=corrupted, memory_budget=budget)
    per_call = documents_per_call(model, batch, memory_budget=budget) if split else docs
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    if split:
        groups = [(list(expand_positions(None, length, batch.roles)), None)]
        run = lambda: grids(model, batch, corrupted, groups, budget)  # noqa: E731
    else:
        run = lambda: interchange_grid(model, batch, corrupted, memory_budget=budget)  # noqa: E731
    seconds, grid = _seconds(run)
    done.set()
    thread.join()
    mib = {name: value / 2**20 for name, value in vars(plan.memory).items()}
    return {
        "budget_MiB": budget / 2**20,
        "model_MiB": base / 2**20,
        "grid_peak_above_model_MiB": (max(peak[0], _rss()) - base) / 2**20,
        "documents": docs,
        "documents_per_call": per_call,
        "chunk_rows": plan.chunk,
        "plan_MiB (all documents in one call)": {**mib, "floor": plan.memory.floor / 2**20},
        "rows": len(grid),
        "seconds": seconds,
        "params": model.num_params(),
    }


def _bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].isalpha() else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["speed", "parity", "memory", "memory-one"])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--grids", default="named,all")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budgets", default="128M,1G")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--split", action="store_true", help="memory: in calls of documents_per_call documents"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "memory-one":
        print(json.dumps(memory_one(_bytes(args.budgets), args.docs, args.length, args.split)))
        return
    if args.what == "speed":
        rows = []
        for family in args.families.split(","):
            for size in args.sizes.split(","):
                for grid in args.grids.split(","):
                    rows.append(measure(family, size, grid, args.repeats))
                    print(json.dumps(rows[-1]), flush=True)
        print(_table(rows))
    elif args.what == "parity":
        rows = parity()
        for r in rows:
            gap, top = r["max_abs_diff"], r["max_logit"]
            print(f"{r['family']:15s} max |diff| {gap:.2e}  (logits up to {top:.1f})")
    else:
        rows = []
        for budget in args.budgets.split(","):
            command = [sys.executable, "-m", "benchmarks.bench_pretrained", "memory-one"]
            command += ["--budgets", budget, "--docs", str(args.docs), "--length", str(args.length)]
            command += ["--split"] if args.split else []
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
