"""``specjax.stream``: one prompt, text yielded as rounds are accepted (for notebooks and scripts)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from specjax import grammar
from specjax.config import GREEDY, SamplingConfig, SpecConfig
from specjax.decode import bucket_length, model_config, resolve_proposer
from specjax.proposers import Proposer
from specjax.request import Request, stop_ids, token_rows
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.slots import SlotEngine
from specjax.serving.text import TextStream

# The speculation lengths k="auto" chooses among (capped by k_max and the proposer's own limit): a step
# program is compiled and timed for each before the first token, so they are few.
AUTO_KS = (0, 2, 4, 8)


def auto_ks(proposer: Proposer, k_max: int) -> tuple[int, ...]:
  """The candidates of ``k="auto"``: 0 and 2, 4, 8 up to ``k_max`` and the proposer's limit."""
  top = min(k_max, proposer.max_k or k_max)
  return tuple(k for k in AUTO_KS if k <= top)


def stream(target, prompt, *, proposer: Proposer | None = None, draft=None, spec: SpecConfig | None = None,
           sampling: SamplingConfig = GREEDY, max_new_tokens: int = 64, seed: int = 0, tokenizer=None,
           eos_id: int | Sequence[int] | None = None, response_format: dict | None = None
           ) -> Iterator[str | list[int]]:
  """Generates for one prompt as :func:`specjax.generate` does, yielding the output as rounds are accepted.

  With a tokenizer it yields text, only once it is stable (:class:`specjax.serving.text.TextStream`: no
  half UTF-8 character, no token decoded without its left context); the pieces join to the decoded
  output. Without one it yields each round's token ids. The output is exactly :func:`specjax.generate`'s
  for the same arguments when greedy; sampled, it follows the same law (the draws differ).

  Args:
    target, proposer, draft, sampling, max_new_tokens, seed, tokenizer, eos_id: as for :func:`specjax.generate`
      (``prompt`` is one text or one list of token ids).
    spec: a static k, or ``k="auto"``: each round's k is chosen among ``auto_ks`` by the serving policy
      (:class:`specjax.serving.policy.SpeculationPolicy`) from timed steps and the measured acceptance.
    response_format: structured output, as for :func:`specjax.generate` (needs ``tokenizer``).

  Returns:
    An iterator over the pieces; the arguments are checked (and the step programs compiled) when
    ``stream`` is called, the rounds run as the iterator is read.

  Raises:
    ValueError: naming the offending argument and its allowed values.
  """
  proposer = resolve_proposer(proposer, draft)
  spec = spec if spec is not None else SpecConfig(k=4 if proposer is not None else 0)
  if not isinstance(spec, SpecConfig) or spec.schedule != "static":
    raise ValueError(f"spec must be a SpecConfig with schedule 'static' (a k or 'auto'), got {spec!r}")
  if proposer is None and (spec.auto or spec.k > 0):
    raise ValueError(f"spec.k={spec.k!r} needs a proposer: pass proposer= or draft=, or SpecConfig(k=0)")
  cfg = model_config(target, "target")
  rows = token_rows(prompt, tokenizer)
  if len(rows) != 1:
    raise ValueError(f"stream takes one prompt, got {len(rows)}")
  ks = auto_ks(proposer, spec.k_max) if spec.auto else (spec.k,)
  stops = stop_ids(eos_id, tokenizer)
  compiled = None
  structured = grammar.Grammar.from_response_format(response_format)
  if structured is not None:
    if tokenizer is None:
      raise ValueError("response_format needs tokenizer= (the grammar is compiled against its vocabulary)")
    try:
      compiled = grammar.compile_grammar(structured, tokenizer, stops)
    except grammar.RequestError as e:
      raise grammar.RequestError("eos_id" if e.field == "stop_ids" else e.field, str(e)) from None
  request = Request(tuple(rows[0]), max_new_tokens, sampling, stops, seed, grammar=compiled)
  request.check(cfg.vocab_size, cfg.max_seq_len - max(ks), room_name=f"the target's cache length max_seq_len="
                                                                     f"{cfg.max_seq_len} less k ({max(ks)})")
  needed = len(rows[0]) + max_new_tokens + max(ks)
  engine = SlotEngine(target, proposer if max(ks) > 0 else None, slots=1,
                      max_len=min(bucket_length(needed), cfg.max_seq_len), ks=ks)
  policy = SpeculationPolicy(engine.time_steps(repeats=3)) if len(ks) > 1 else None
  engine.insert([request])
  return _rounds(engine, policy, TextStream(tokenizer) if tokenizer is not None else None)


def _rounds(engine: SlotEngine, policy: SpeculationPolicy | None, text: TextStream | None
            ) -> Iterator[str | list[int]]:
  while engine.live_slots:
    k = policy.choose(engine.width) if policy is not None else engine.ks[0]
    result = engine.step(k)
    if policy is not None:
      timed = not (result.cold or result.queued)  # (a first run, or a step behind the insert, times no step)
      policy.observe(result.width, k, result.seconds if timed else None, result.reached, result.accepted_at,
                     accepted=sum(result.accepted.values()), row_rounds=sum(result.row_rounds.values()))
    new = result.tokens.get(0, [])
    if text is None:
      if new:
        yield new
    elif piece := text.push(new):
      yield piece
  if text is not None and (rest := text.finish()):
    yield rest
