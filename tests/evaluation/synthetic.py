"""Evidence tables written by hand for the report's rendering tests: the rows the report's
evidence table has (mecheval.evaluation.analysis.evidence_table), values chosen so each
architecture reads out as the study found."""

from __future__ import annotations

import pandas as pd

AR = "ar(num_pairs=4, num_keys=16), 3,000 steps"
ATR = "atr(max_rhs_len=5, num_terminals=20), 3,000 steps"


def model(task, setting, arch, acc, readouts, convs=None, d_model=64, n_layers=2, seeds=1):
    """One evidence row: `readouts` (induction, direct_early, direct_late) each with a document
    interval of -0.05/+0.04 and, over `seeds` > 1, a seeds interval of -0.1/+0.08; `convs`:
    conv read-out name -> value, interval -0.03/+0.03."""
    row = {
        "run": f"{task}-{arch}-d{d_model}-l{n_layers}",
        "task": task,
        "setting": setting,
        "arch": arch,
        "d_model": d_model,
        "n_layers": n_layers,
        "lr": 1e-3,
        "dev_accuracy": acc,
        "seed": 0,
        "study_scale": False,
        "seeds": seeds,
    }
    for name, value in zip(("induction", "direct_early", "direct_late"), readouts, strict=True):
        row.update({name: value, f"{name}_low": value - 0.05, f"{name}_high": value + 0.04})
        if seeds > 1:
            row.update({f"{name}_seeds_low": value - 0.1, f"{name}_seeds_high": value + 0.08})
    best = max(zip(readouts, ("induction", "direct_early", "direct_late"), strict=True))
    row["mechanism"] = best[1] if best[0] >= 0.5 else "unclear"
    for name, value in (convs or {}).items():
        row.update({name: value, f"{name}_low": value - 0.03, f"{name}_high": value + 0.03})
    return row


def study_like() -> pd.DataFrame:
    """AR: every architecture of the study; ATR: the three of finding 5."""
    rows = [
        model("ar", AR, "attention", 1.0, (0.93, 0.01, 0.02), seeds=2),
        model("ar", AR, "attention", 0.9, (0.5, 0.3, 0.0), d_model=32),  # less accurate width
        model("ar", AR, "based", 0.99, (0.88, 0.02, 0.0), {"conv_value": 0.1}),
        model("ar", AR, "mamba", 0.81, (0.05, 0.72, 0.1), {"conv_value+1": 0.71}),
        model("ar", AR, "mamba_noconv", 0.05, (0.01, 0.02, -0.03)),
        model(
            "ar",
            AR,
            "deltanet",
            0.9,
            (0.1, 0.4, 0.62),
            {"q_conv_value+1": 0.1, "k_conv_value+1": 0.5, "v_conv_value+1": 0.3},
        ),
        model("ar", AR, "h3", 0.02, (0.0, 0.01, 0.0)),
        model("ar", AR, "hyena", 0.03, (0.01, 0.0, 0.0)),
        model("ar", AR, "mamba", 0.7, (0.1, 0.2, 0.1), n_layers=3),  # not a 2-layer read-out
        model("atr", ATR, "attention", 0.95, (0.97, 0.0, 0.01)),
        model("atr", ATR, "based", 0.9, (0.91, 0.02, 0.0)),
        model("atr", ATR, "mamba_noconv", 0.8, (0.82, 0.1, 0.0)),
    ]
    return pd.DataFrame(rows)


def attrib_cells() -> tuple[pd.DataFrame, pd.DataFrame]:
    """An attrib table of a 2-layer model (value at layer 1's input = 0.9) and its grid's
    positions (key 3, value 4, query 10, value+1 5), listed out of document order."""
    positions = {"query": 10, "key": 3, "value+1": 5, "value": 4}
    rows = []
    for layer in (0, 1):
        for site in ("block_input", "mixer_output"):
            for i, position in enumerate(positions):
                value = 0.9 if (layer, site, position) == (1, "block_input", "value") else i / 10
                rows.append(
                    {
                        "layer": layer,
                        "site": site,
                        "position": position,
                        "attrib": value,
                        "p_original": 0.99,
                        "p_corrupted": 0.1,
                        "p_restored": 0.5,
                        "n": 64,
                    }
                )
    grid = pd.DataFrame([{"position": p, "position_index": i} for p, i in positions.items()] * 3)
    return pd.DataFrame(rows), grid
