"""specjax: speculative decoding for JAX/Flax language models."""

from specjax.acceptance import accept, residual
from specjax.cache import KVCache, cache_bytes
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import GenerateOutput, SpecStats, draft_rollout, generate, generate_tokens, verify
from specjax.loading import Loaded, load
from specjax.hf import HFCheckpointError, load_hf, load_hf_pair, save_hf
from specjax.ngram import ngram_propose
from specjax.sampling import sample, warp
from specjax.tokenizer import (BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError,
                               check_same_vocab, load_tokenizer)

__version__ = "0.1.0"

__all__ = [
    "GREEDY", "BPETokenizer", "ByteTokenizer", "GenerateOutput", "HFCheckpointError", "HFTokenizer", "KVCache",
    "SamplingConfig", "SpecConfig", "SpecStats", "Tokenizer", "TokenizerError", "accept", "cache_bytes",
    "check_same_vocab", "draft_rollout", "Loaded", "generate", "generate_tokens", "load", "load_hf",
    "load_hf_pair", "load_tokenizer", "ngram_propose", "residual", "sample", "save_hf", "verify",
    "warp",
]
