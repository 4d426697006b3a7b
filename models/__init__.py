"""Model definitions (installed as ``specjax.models``): one file per family, one forward contract."""

from specjax.models.gpt2 import GPT2, GPT2Config
from specjax.models.llama import Llama, LlamaConfig, RopeScaling

__all__ = ["GPT2", "GPT2Config", "Llama", "LlamaConfig", "RopeScaling"]
