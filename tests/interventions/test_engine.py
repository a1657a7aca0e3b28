"""The patched-run engine's metrics (mecheval.interventions.engine.Metrics) against a plain
log-softmax of the full logits."""

from __future__ import annotations

import pytest
import torch

from tests.interventions.test_grid import TASK, _model


@pytest.mark.parametrize("size", [1.0, 1e3], ids=["unshifted", "shifted"])
def test_metrics_equal_a_log_softmax(size):
    """The grid's metrics (one log-sum-exp per row, shifted by the row's largest logit only
    when the logits may leave the floats' range) against a plain log-softmax."""
    from mecheval.interventions.engine import UNSHIFTED, Metrics

    model = _model("attention")
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(5, 16, generator=g)
    hidden = torch.randn(700, 16, generator=g) * size
    rows = torch.randint(0, 5, (700,), generator=g)
    answers = torch.randint(0, TASK.vocab_size, (700,), generator=g)
    with torch.no_grad():
        metrics = Metrics.of(model, clean)
    bound = float(hidden.norm(dim=1).max()) * metrics.head_norm2
    assert (bound <= UNSHIFTED) == (size == 1.0)
    with torch.no_grad():
        p, logit, kl = metrics(hidden, answers, rows)
    weight = model.unembedding.detach()
    log_q = torch.log_softmax(hidden @ weight.T, -1).double()
    log_p = torch.log_softmax(clean @ weight.T, -1).double()[rows]
    picked = log_q.gather(1, answers[:, None])[:, 0]
    torch.testing.assert_close(p.double(), picked.exp(), rtol=1e-4, atol=1e-7)
    expected_logit = (hidden @ weight.T).gather(1, answers[:, None])[:, 0]
    torch.testing.assert_close(logit, expected_logit, rtol=1e-5, atol=1e-5)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-3, atol=1e-4 * size)
