"""The mini Llama: configuration, the one-device model, and byte-level data.

    python -m distlab.train --config tiny
"""

from distlab.model.config import ModelConfig, load_config
from distlab.model.llama import Llama

__all__ = ["ModelConfig", "load_config", "Llama"]
