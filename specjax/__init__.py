"""specjax: speculative decoding for JAX/Flax language models."""

from specjax import distributed, proposers, sharding
from specjax.acceptance import accept, residual
from specjax.cache import KVCache, cache_bytes
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import GenerateOutput, SpecStats, generate, generate_tokens
from specjax.engine import DecodeState, init_state, round_step, verify
from specjax.hf import CheckpointFileError, load_hf, load_hf_pair, save_hf
from specjax.loading import Loaded, load
from specjax.chat import ChatFormat
from specjax.gguf import load_gguf
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram, Proposer, draft_rollout, ngram_propose
from specjax.sampling import sample, warp
from specjax.serving.stream import stream
from specjax.tokenizer import (BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError,
                               check_same_vocab, load_tokenizer)

__version__ = "0.1.0"

__all__ = [
    "GREEDY", "MTP", "BPETokenizer", "ByteTokenizer", "ChatFormat", "DecodeState", "DraftModel", "Eagle",
    "GenerateOutput", "CheckpointFileError", "HFTokenizer", "KVCache", "Loaded", "Medusa", "NGram", "Proposer",
    "SamplingConfig", "SpecConfig", "SpecStats", "Tokenizer", "TokenizerError", "accept", "cache_bytes",
    "check_same_vocab", "distributed", "draft_rollout", "generate", "generate_tokens", "init_state", "load",
    "load_gguf", "load_hf", "load_hf_pair", "load_tokenizer", "ngram_propose", "proposers", "residual",
    "round_step", "sample", "save_hf", "sharding", "stream", "verify", "warp",
]
