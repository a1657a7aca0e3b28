"""The GPU check: run the GPU tests (bf16 included) and every benchmark, and write one JSON
of every figure (GPU name, torch and triton versions, test outcomes, benchmark timings).

    python benchmarks/gpu_run.py --out DIR [--budget-s 450] [--tests tests/kernels ...]

Made to finish inside a short GPU lease: each stage has a time limit and the JSON is written
after every stage, so a stage that overruns still leaves the figures of the others. On a
machine without CUDA it runs the same stages on CPU (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/kernels", "tests/layers", "tests/models"]


def environment() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
        try:
            smi = [
                "nvidia-smi",
                "--query-gpu=driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ]
            info["nvidia_smi"] = subprocess.run(
                smi, capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    from benchmarks.common import measure_copy_bandwidth

    info["copy_GB/s"] = round(measure_copy_bandwidth(), 1)
    return info


LOG: Path | None = None  # every pytest stage's output is appended here (set in main)


def import_paths() -> list[str]:
    """The checkout, and a folder where the kernel library imports by its installed name
    (`mecheval_kernels`, folder kernels/), for a machine where mecheval is not installed."""
    # One folder per checkout: a link left by another checkout would import its kernels.
    tag = hashlib.sha1(str(REPO).encode()).hexdigest()[:10]
    links = Path(os.environ.get("TMPDIR", "/tmp")) / f"mecheval-import-{tag}"
    links.mkdir(exist_ok=True)
    link = links / "mecheval_kernels"
    if not link.exists():
        link.symlink_to(REPO / "kernels", target_is_directory=True)
    return [str(REPO), str(links)]


def _pytest(args: list[str], timeout_s: float, **env_extra: str) -> tuple[int, float]:
    path = os.pathsep.join(filter(None, [*import_paths(), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **env_extra)
    if _has("pytest_timeout"):
        args = [*args, "--timeout=240"]  # one hung test must not eat the lease
    start = time.time()
    with open(LOG, "a") as log:
        log.write(f"\n===== pytest {' '.join(args)}\n")
        log.flush()
        try:
            rc = subprocess.run(
                [sys.executable, "-m", "pytest", *args],
                cwd=REPO,
                env=env,
                timeout=timeout_s,
                stdout=log,
                stderr=subprocess.STDOUT,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -9
            log.write(f"\n===== stage timed out after {timeout_s:.0f} s\n")
    return rc, round(time.time() - start, 1)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_tests(paths: list[str], out: Path, timeout_s: float) -> dict:
    junit = out / "tests.xml"
    args = [
        *paths,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    if _has("xdist"):
        args += ["-n", "8"]  # Triton compiles each specialisation on the CPU: spread them out
    rc, seconds = _pytest(args, timeout_s)
    result: dict = {"paths": paths, "returncode": rc, "seconds": seconds}
    if not junit.exists():
        result["error"] = "no junit report (timed out or crashed)"
        return result
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (bad.get("message") or "")[:600]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    result.update(counts, failures=failures[:60])
    return result


def run_benchmarks(name: str, selection: list[str], out: Path, timeout_s: float) -> dict:
    """One benchmark stage: pytest-benchmark over `selection`, its figures flattened.

    Figures are streamed to a JSON-lines file as each benchmark finishes (see
    benchmarks/conftest.py), so a stage cut off by its time limit keeps what it measured.
    """
    stream = out / f"bench_{name}.jsonl"
    stream.unlink(missing_ok=True)
    args = [
        *selection,
        "--benchmark-only",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={out / f'bench_{name}.json'}",
        "--benchmark-max-time=0.25",
        "--benchmark-min-rounds=5",
    ]
    rc, seconds = _pytest(args, timeout_s, MECHEVAL_BENCH_STREAM=str(stream))
    figures = []
    if stream.exists():
        figures = [json.loads(line) for line in stream.read_text().splitlines() if line]
    result: dict = {"selection": selection, "returncode": rc, "seconds": seconds}
    if rc == -9:
        result["error"] = f"timed out after {seconds} s; {len(figures)} figures kept"
    result["figures"] = figures
    return result


# (stage name, pytest selection, share of the time left when the stage starts)
BENCHMARK_STAGES = [
    (
        "kernels",
        [
            "benchmarks/bench_short_conv.py",
            "benchmarks/bench_selective_scan.py",
            "benchmarks/bench_delta_rule.py",
            "benchmarks/bench_gated_delta_rule.py",
            "benchmarks/bench_mamba2.py",
            "benchmarks/bench_dplr_delta_rule.py",
            "benchmarks/bench_mamba3.py",
        ],
        0.45,
    ),
    (
        "delta_family",  # issue 55: KDA, Gated DeltaProduct, Comba vs fla's chunk kernels
        [
            "benchmarks/bench_kda.py",
            "benchmarks/bench_gated_delta_product.py",
            "benchmarks/bench_comba.py",
            "-k",
            "not naive and not reference",
        ],
        0.3,
    ),
    ("models", ["benchmarks/bench_models.py", "-k", "not compiled"], 0.5),
    ("stacked", ["benchmarks/bench_stacked.py"], 0.4),
    (
        "compiled",
        [
            "benchmarks/bench_models.py",
            "-k",
            "compiled and (attention or mamba or deltanet) and not noconv",
        ],
        0.95,
    ),
]


def ratios(figures: list[dict]) -> list[dict]:
    """Within each benchmark group: every implementation's time relative to ours."""
    groups: dict[str, list[dict]] = {}
    for f in figures:
        groups.setdefault(f["group"], []).append(f)
    rows = []
    for group, members in groups.items():
        ours = [m for m in members if str(m.get("impl", "")).startswith("ours")]
        for base in ours:
            for other in members:
                if other is base:
                    continue
                rows.append(
                    {
                        "group": group,
                        "ours": base.get("impl"),
                        "vs": other.get("impl", other["name"]),
                        "speedup": round(other["median_s"] / base["median_s"], 3),
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=450, help="whole-run time limit")
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS)
    parser.add_argument(
        "--test-share", type=float, default=0.4, help="share of the budget for tests"
    )
    parser.add_argument("--skip", nargs="*", default=[], help="benchmark stages to skip")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global LOG
    LOG = args.out / "run.log"
    sys.path[:0] = import_paths()
    start = time.time()
    results: dict = {"environment": environment()}
    path = args.out / "gpu_results.json"

    def save() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)

    save()
    left = lambda: args.budget_s - (time.time() - start)  # noqa: E731
    results["tests"] = run_tests(args.tests, args.out, timeout_s=args.test_share * left())
    save()
    results["benchmarks"] = {}
    for name, selection, share in BENCHMARK_STAGES:
        if name in args.skip or left() < 20:
            continue
        results["benchmarks"][name] = run_benchmarks(name, selection, args.out, share * left())
        figures = [f for stage in results["benchmarks"].values() for f in stage["figures"]]
        results["ratios"] = ratios(figures)
        save()
    results["seconds"] = round(time.time() - start, 1)
    save()

    env = results["environment"]
    gpu = env.get("gpu", "cpu")
    print(f"\n{gpu} torch {env['torch']} triton {env['triton']} copy {env['copy_GB/s']} GB/s")
    t = results["tests"]
    counts = ", ".join(f"{t.get(k)} {k}" for k in ("passed", "failed", "skipped"))
    print(f"tests: {counts} in {t['seconds']} s")
    for f in t.get("failures", [])[:15]:
        print(f"  FAIL {f['test']}: {f['message'][:160]}")
    for f in [f for stage in results["benchmarks"].values() for f in stage["figures"]]:
        impl = f"{f.get('arch', '')} {f.get('impl')}".strip()[:30]
        ms = f["median_s"] * 1e3
        rate = f"{f['GB/s']} GB/s" if "GB/s" in f else f"{f.get('steps/s', '')} steps/s"
        print(f"  {f['group'][:56]:56s} {impl:30s} {ms:10.3f} ms {rate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
