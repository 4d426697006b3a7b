"""specjax: speculative decoding for JAX/Flax language models."""

from specjax import distributed, proposers, sharding
from specjax.acceptance import accept, residual
from specjax.cache import KVCache, cache_bytes
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import GenerateOutput, SpecStats, generate, generate_tokens
from specjax.engine import DecodeState, Tokens, init_state, put_rows, round_step, take_rows, verify
from specjax.hf import CheckpointFileError, load_hf, load_hf_pair, save_hf
from specjax.loading import Loaded, load
from specjax.chat import ChatFormat
from specjax.gguf import load_gguf
from specjax.proposers import MTP, DraftModel, Eagle, Medusa, NGram, Proposer, draft_rollout, ngram_propose
from specjax.request import Request, RequestError
from specjax.sampling import Mode, RowSettings, Sampler, sample, warp
from specjax.serving.stream import stream
from specjax.tokenizer import (BPETokenizer, ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError,
                               check_same_vocab, load_tokenizer)

__version__ = "0.1.0"

__all__ = [
    "GREEDY", "MTP", "BPETokenizer", "ByteTokenizer", "ChatFormat", "DecodeState", "DraftModel", "Eagle",
    "GenerateOutput", "CheckpointFileError", "HFTokenizer", "KVCache", "Loaded", "Medusa", "Mode", "NGram",
    "Proposer", "Request", "RequestError", "RowSettings", "Sampler", "SamplingConfig", "SpecConfig", "SpecStats",
    "Tokenizer", "TokenizerError", "Tokens", "accept", "cache_bytes", "check_same_vocab", "distributed",
    "draft_rollout", "generate", "generate_tokens", "init_state", "load", "load_gguf", "load_hf", "load_hf_pair",
    "load_tokenizer", "ngram_propose", "proposers", "put_rows", "residual", "round_step", "sample", "save_hf",
    "sharding", "stream", "take_rows", "verify", "warp",
]
