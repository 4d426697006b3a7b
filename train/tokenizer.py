"""Training the byte-level BPE tokenizer of a target run.

The tokenizer class itself, :class:`specjax.tokenizer.BPETokenizer`, lives in the engine package so that
loading a trained model never imports ``specjax.train``.
"""

from __future__ import annotations

from collections.abc import Iterable

from specjax.tokenizer import EOS, BPETokenizer, TokenizerError


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
  """Trains a byte-level BPE with exactly ``vocab_size`` tokens (256 bytes, merges and EOS).

  Deterministic for the same texts (single pass, fixed order).

  Args:
    texts: the training documents.
    vocab_size: the number of tokens, ``data.tokenizer_vocab`` of the recipe.

  Returns:
    The trained :class:`~specjax.tokenizer.BPETokenizer` (in memory; ``save`` writes it).

  Raises:
    TokenizerError: the texts hold too few distinct merges for ``vocab_size`` tokens.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
  tok.train_from_iterator(texts, trainer=trainer)
  out = BPETokenizer(tok)
  if out.vocab_size != vocab_size:
    raise TokenizerError(f"the corpus is too small for data.tokenizer_vocab={vocab_size}: BPE found only "
                         f"{out.vocab_size} tokens")
  return out
