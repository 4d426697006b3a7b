"""specjax: speculative decoding for JAX/Flax language models."""

from specjax.acceptance import accept, residual
from specjax.cache import KVCache, cache_bytes
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import GenerateOutput, SpecStats, draft_rollout, generate, generate_tokens, verify
from specjax.loading import Loaded, load
from specjax.hf import CheckpointError, HFTokenizer, check_same_vocab, load_hf, load_hf_pair, save_hf
from specjax.chat import ChatFormat
from specjax.gguf import load_gguf
from specjax.ngram import ngram_propose
from specjax.sampling import sample, warp
from specjax.tokenizer import ByteTokenizer

__version__ = "0.1.0"

__all__ = [
    "GREEDY", "ByteTokenizer", "ChatFormat", "CheckpointError", "GenerateOutput", "HFTokenizer", "KVCache",
    "SamplingConfig", "SpecConfig", "SpecStats", "accept", "cache_bytes", "check_same_vocab", "draft_rollout",
    "Loaded", "generate", "generate_tokens", "load", "load_gguf", "load_hf", "load_hf_pair", "ngram_propose",
    "residual", "sample", "save_hf", "verify", "warp",
]
