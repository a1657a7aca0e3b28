"""The errors of the delta-rule family's new ops against flash-linear-attention 0.6.0's own naive
references, in fp32 and in fp64 (fla's references run with their casts to float32 made casts to
float64): the largest absolute error and the relative L2 error of the output and of the final
state, on the PyTorch path.

Run: python -m benchmarks.delta_family_errors [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F

from mecheval_kernels import chunk_comba, chunk_gated_delta_product, chunk_kda

B, T, H, K, V, N = 2, 256, 2, 32, 32, 2  # N: Gated DeltaProduct's steps a token


class _Float64Torch:
    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _float64(module):
    real, real_float = module.torch, torch.Tensor.float
    module.torch, torch.Tensor.float = _Float64Torch(), torch.Tensor.double
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = real, real_float


def _inputs(dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    unit = lambda *s: F.normalize(make(*s), dim=-1)  # noqa: E731
    x = dict(
        q=unit(B, T, H, K), k=unit(B, T, H, K), p=unit(B, T, H, K), v=make(B, T, H, V),
        g=F.logsigmoid(make(B, T, H) + 2), gk=F.logsigmoid(make(B, T, H, K) + 2),
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        kn=unit(B, N * T, H, K), vn=make(B, N * T, H, V),
        betan=torch.rand(B, N * T, H, generator=gen, dtype=torch.float64),
        state=make(B, H, K, V),
    )  # fmt: skip
    return {name: t.to(dtype) for name, t in x.items()}


def _pairs(x: dict) -> dict:
    """op -> (ours, fla's naive), each () -> (o, final state)."""
    from fla.ops.comba import naive as comba
    from fla.ops.gated_delta_product import naive as product
    from fla.ops.kda import naive as kda

    s = x["state"]
    return {
        "chunk_kda": (
            lambda: chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], None, s, True),
            (kda, lambda: kda.naive_recurrent_kda(
                x["q"], x["k"], x["v"], x["gk"], x["beta"], None, s.clone(), True)),
        ),
        "chunk_gated_delta_product": (
            lambda: chunk_gated_delta_product(
                x["q"], x["kn"], x["vn"], x["g"], x["betan"], N, None, s, True),
            (product, lambda: product.naive_recurrent_gated_delta_product(
                x["q"], x["kn"], x["vn"], x["g"], x["betan"], K**-0.5, initial_state=s.clone(),
                output_final_state=True, num_householder=N)),
        ),
        "chunk_comba": (
            lambda: chunk_comba(x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"], None, s, True),
            (comba, lambda: comba.naive_chunk_comba(
                x["q"], x["k"], x["v"], x["p"], x["g"], x["beta"], chunk_size=64,
                initial_state=s.clone(), output_final_state=True)),
        ),
    }  # fmt: skip


def _errors(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    a, b = ours.double(), theirs.double()
    return {"max_abs": (a - b).abs().max().item(), "rel_l2": ((a - b).norm() / b.norm()).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"B{B} T{T} H{H} K{K} V{V}, PyTorch path")
    for dtype in (torch.float32, torch.float64):
        for op, (ours, (module, naive)) in _pairs(_inputs(dtype)).items():
            with _float64(module) if dtype == torch.float64 else contextlib.nullcontext():
                o_ref, final_ref = naive()
            o, final = ours()
            row = {"op": op, "dtype": str(dtype), "o": _errors(o, o_ref),
                   "final_state": _errors(final, final_ref)}  # fmt: skip
            rows.append(row)
            print(f"{op:28s} {str(dtype):14s} o: max {row['o']['max_abs']:.1e} "
                  f"rel {row['o']['rel_l2']:.1e}; final: max {row['final_state']['max_abs']:.1e} "
                  f"rel {row['final_state']['rel_l2']:.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, T, H, K, V], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
