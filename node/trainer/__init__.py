"""The trainer: GRPO/SAPO updates on verified rollouts, crash-safe buffer and checkpoints.

Import the submodules directly (`from .trainer import Trainer`); nothing heavy happens at
import time of this package.
"""
