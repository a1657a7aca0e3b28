"""mecheval: train Transformers and state space models on associative recall, then run
batched causal interventions to see how each model solves the task."""

__version__ = "0.1.0"
