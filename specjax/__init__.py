"""specjax: speculative decoding for JAX/Flax language models."""

from specjax.acceptance import accept, residual
from specjax.cache import KVCache, cache_bytes
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import GenerateOutput, SpecStats, draft_rollout, generate, generate_tokens, verify
from specjax.sampling import sample, warp
from specjax.tokenizer import ByteTokenizer

__version__ = "0.1.0"

__all__ = [
    "GREEDY", "ByteTokenizer", "GenerateOutput", "KVCache", "SamplingConfig", "SpecConfig", "SpecStats",
    "accept", "cache_bytes", "draft_rollout", "generate", "generate_tokens", "residual", "sample",
    "verify", "warp",
]
