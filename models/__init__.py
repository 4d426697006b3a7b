"""Model definitions (installed as ``specjax.models``): one file per family, one forward contract."""

from specjax.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
