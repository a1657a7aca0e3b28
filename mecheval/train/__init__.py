"""Training: the study's recipe as a typed config, a resumable loop, atomic checkpoints."""

from mecheval.train.config import TrainConfig, load_train_config
from mecheval.train.loop import load_trained_model, train

__all__ = ["TrainConfig", "load_train_config", "load_trained_model", "train"]
