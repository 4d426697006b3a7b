"""The serving engine in process (specjax.serving): exact greedy output per request whatever shares the slots
and whatever k each step runs, a sampled request's law and its independence from its neighbours, the k
policy, incremental text and stop strings, specjax.stream, failures that stay with their request, and no
recompilation or memory growth over many requests."""

from __future__ import annotations

import dataclasses
import itertools
import json
import resource
import threading

import jax
import numpy as np
import pytest

import specjax
import specjax.pretrained
from helpers import SMALL, backend_compiles, make_model
from specjax import SamplingConfig, SpecConfig, stream
from specjax.models.heads import build_heads
from specjax.proposers import DraftModel, Eagle, NGram
from specjax.serving.policy import PolicyConfig, SpeculationPolicy
from specjax.serving.scheduler import Event, Job, QueueFull, Scheduler, ShuttingDown
from specjax.request import Request, RequestError
from specjax.cache import KVCache
from specjax.serving.slots import TRACE_COUNTS, SlotEngine, default_prompt_buckets, tree_window
from specjax.serving.text import StopStrings, TextStream
from specjax.tokenizer import ByteTokenizer, byte_level_tokenizer, load_tokenizer
from specjax.tree import DynamicTree, TreeShape
from test_distribution import PASS_P, TINY, chi_square_pvalue, exact_joint

GREEDY = SamplingConfig(temperature=0.0)


# One engine configuration for most tests, so that they share its compiled programs: 4 slots at widths 1
# and 4, 64 positions, steps with k = 0 and k = 2 (DraftModel over the session's draft).
SLOTS, MAX_LEN, KS, WIDTHS = 4, 64, (0, 2), (1, 4)
REF_NEW = 24  # every greedy reference is generate's first REF_NEW tokens (one program per prompt bucket)


def make_engine(target, draft, **kwargs) -> SlotEngine:
  return SlotEngine(target, DraftModel(draft), **{"slots": SLOTS, "max_len": MAX_LEN, "ks": KS, "widths": WIDTHS,
                                                  **kwargs})


def random_requests(n: int, seed: int, max_prompt: int = 30, max_new: int = REF_NEW, vocab: int = SMALL.vocab_size,
                    sampled_every: int = 0) -> list[Request]:
  """Mixed prompt lengths, output lengths and stop tokens; every ``sampled_every``-th request samples."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    sampled = sampled_every and i % sampled_every == 1
    sampling = SamplingConfig(temperature=0.9, top_k=int(rng.integers(0, 8)), top_p=0.8) if sampled else GREEDY
    out.append(Request(prompt=tuple(rng.integers(0, vocab, int(rng.integers(1, max_prompt + 1))).tolist()),
                           max_new_tokens=int(rng.integers(1, max_new + 1)), sampling=sampling,
                           stop_ids=(int(rng.integers(0, vocab)),) if i % 3 == 0 else (), seed=int(rng.integers(1 << 31))))
  return out


def reference(target, request: Request) -> list[int]:
  """What generate gives for the request's prompt alone: greedy output is a prefix of a longer one, so the
  first REF_NEW tokens (one compiled program) cut at the request's first stop token and its max tokens."""
  row = specjax.generate(target, [list(request.prompt)], max_new_tokens=REF_NEW).rows()[0]
  stops = [i for i, t in enumerate(row) if t in request.stop_ids]
  return row[:min(request.max_new_tokens, stops[0] + 1 if stops else REF_NEW)]


def take_tokens(result, owner: dict, out: dict, results=None) -> None:
  """A step's tokens added to ``out`` by request (``owner``: slot -> request index); finished slots leave
  ``owner``; ``results`` (a list, or None) receives the step."""
  if results is not None:
    results.append(result)
  for slot, tokens in result.tokens.items():
    out[owner[slot]] += tokens
  for slot in result.finished:
    del owner[slot]


def drive(engine: SlotEngine, requests: list[Request], ks=None, start_at=None, widths=None,
          results=None) -> dict[int, list[int]]:
  """Runs ``requests`` through ``engine`` as a server does (admit into free slots, compact, step), request i
  entering no earlier than step ``start_at[i]``; step s runs ``ks[s % len(ks)]`` (a k or a tree). Returns each
  request's tokens; ``widths`` (a list) receives each step's width, ``results`` (a list) each StepResult."""
  ks = ks or engine.ks
  start_at = start_at or [0] * len(requests)
  pending, owner, out = list(range(len(requests))), {}, {i: [] for i in range(len(requests))}
  for step in itertools.count():
    while engine.free_slots and pending and start_at[pending[0]] <= step:
      i = pending.pop(0)
      (slot,) = engine.insert([requests[i]])
      owner[slot] = i
    if not owner and not pending:
      return out
    engine.compact()
    result = engine.step(ks[step % len(ks)])
    if widths is not None:
      widths.append(result.width)
    take_tokens(result, owner, out, results)


def test_greedy_equals_generate_per_request_whatever_shares_the_slots(target, draft):
  """Requests of mixed lengths, stop tokens and settings (sampled neighbours), inserted mid-flight as slots
  free up, under a schedule that switches k every step, while the state grows and shrinks between widths
  1 and 4 (rows moving): each greedy request equals generate for its prompt alone."""
  engine = make_engine(target, draft, shrink_after=2)
  requests = random_requests(12, seed=0, sampled_every=3)
  widths = []
  out = drive(engine, requests, ks=(2, 0, 0, 2, 2, 0), start_at=[0, 2, 3, 5, 5, 9, 40, 40, 40, 41, 41, 70],
              widths=widths)
  assert set(widths) == set(WIDTHS) and any(a > b for a, b in zip(widths, widths[1:]))  # grew and shrank
  for i, r in enumerate(requests):
    if r.sampling.greedy:
      assert out[i] == reference(target, r), i
  assert engine.free_slots == SLOTS and not engine.live_slots


def test_a_sampled_request_depends_on_its_own_seed_alone(target, draft):
  """Per-row keys: a sampled request gives the same tokens alone and among other requests inserted at
  other times, its row moving between widths (for the same k per step), and another seed gives other
  tokens."""
  engine = make_engine(target, draft, shrink_after=1)
  probe = Request(prompt=(5, 9, 5, 9, 5), max_new_tokens=24, sampling=SamplingConfig(0.8, top_p=0.9), seed=7)
  alone = drive(engine, [probe], ks=(2,))[0]
  others = random_requests(5, seed=1, sampled_every=2)
  widths = []
  crowded = drive(engine, others[:2] + [probe] + others[2:], ks=(2,), start_at=[0, 0, 2, 3, 6, 6], widths=widths)[2]
  assert crowded == alone and len(set(widths)) > 1
  assert drive(engine, [Request(probe.prompt, 24, probe.sampling, seed=8)], ks=(2,))[0] != alone


def run_out(engine: SlotEngine, slots: list[int]) -> dict[int, list[int]]:
  """Steps ``engine`` (plain rounds) until the requests in ``slots`` have finished; their tokens by slot."""
  owner, out = {slot: slot for slot in slots}, {slot: [] for slot in slots}
  while owner:
    take_tokens(engine.step(0), owner, out)
  return out


def test_a_kept_prompt_skips_its_prefill_and_gives_what_its_own_prefill_would(target, draft):
  """prompt_cache: a request whose whole prompt was prefilled before takes the kept row (no prefill runs) with
  its own key and settings, so each request gives the tokens of an engine that keeps none (a sampled repeat
  of a greedy prompt, a greedy repeat of a sampled one: the key and the settings are the request's); beyond
  the bound the least recently used prompt is dropped; a prefix of a kept prompt starts from its caches (no
  prefill); rows of a prefill of several prompts and a prompt prefilled in chunks are kept too."""
  a, b, c = random_requests(3, seed=5, sampled_every=2)  # b samples
  assert a.sampling.greedy and not b.sampling.greedy and len(a.prompt) > 1
  requests = [a, b, dataclasses.replace(a, sampling=SamplingConfig(0.9, top_p=0.9), seed=3),
              dataclasses.replace(b, sampling=GREEDY), c, dataclasses.replace(a, seed=4),
              Request(a.prompt[:-1], 6)]
  # kept (2): a | a b | b a (hit) | a b (hit) | b c | c a | a a[:-1]
  start = [0, 1, 3, 5, 7, 9, 11]
  plain = drive(make_engine(target, draft), requests, ks=(2, 0), start_at=start)
  engine = make_engine(target, draft, prompt_cache=2)
  assert drive(engine, requests, ks=(2, 0), start_at=start) == plain
  assert (engine.prompt_hits, engine.prefix_hits, engine.prefills, engine.kept_prompts) == (2, 1, 4, 2)
  assert engine.prefix_tokens == len(a.prompt) - 1
  assert engine.prompt_cache_bytes > 0
  engine.clear_prompt_cache()
  assert engine.kept_prompts == 0 and engine.prompt_cache_bytes == 0

  # One prefill of two prompts keeps a row for each; then each comes back alone, sampled.
  x, y = (Request(tuple(range(3 + i, 9 + i)), 8, SamplingConfig(1.0), seed=20 + i) for i in range(2))
  engine = make_engine(target, draft, prompt_cache=4)
  slots = engine.insert([x, y])
  first = run_out(engine, slots)
  assert engine.prefills == 1 and engine.kept_prompts == 2
  for r, slot in [(y, slots[1]), (x, slots[0])]:
    (again,) = engine.insert([r])
    assert run_out(engine, [again])[again] == first[slot]
  assert engine.prompt_hits == 2 and engine.prefills == 1

  # A long prompt prefilled in chunks is kept; its repeat is not chunked and takes the kept row.
  engine = make_engine(target, draft, prompt_cache=1, prefill_chunk=16)
  long = Request(tuple(int(t) for t in np.random.default_rng(3).integers(0, SMALL.vocab_size, 40)), 8)
  assert engine.chunks(long)
  slot = engine.start_prefill(long)
  while engine.prefill_next() is None:
    pass
  chunked = run_out(engine, [slot])[slot]
  assert not engine.chunks(long) and drive(engine, [long])[0] == chunked and engine.prompt_hits == 1
  assert chunked == reference(target, long)
  with pytest.raises(ValueError, match=r"prompt_cache must be an integer >= 0, got -1"):
    make_engine(target, draft, prompt_cache=-1)


def _prefilled(engine: SlotEngine, prompt: tuple[int, ...]) -> list[np.ndarray]:
  """The kept prefilled row of ``prompt`` (``prompt_cache``: its caches, each cut to its rows' length, proposer
  state, last token and counts) and the target's features over the prompt."""
  _, row, features = engine._kept[prompt]
  cut = lambda c: [np.asarray(x)[:, :int(c.lengths[0])] for x in (*c.k, *c.v)] if isinstance(c, KVCache) else [c]
  leaves = jax.tree.leaves((row.target_cache, row.proposer, row.last, row.counts),
                           is_leaf=lambda x: isinstance(x, KVCache))
  return [np.asarray(x) for leaf in leaves for x in cut(leaf)] + [np.asarray(x)[:, :len(prompt)]
                                                                   for x in jax.tree.leaves(features)]


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_a_prompt_sharing_a_prefix_with_a_kept_one_passes_only_the_rest(target, draft, kind):
  """prompt_cache: a prompt that extends a kept one (a conversation's next turn), shares a long prefix with one
  (a system prompt) or is a prefix of one starts from the kept prompt's caches and features and passes only
  the rest of its own through the target: the tokens of an engine that keeps none, greedy and sampled, with
  speculation from a draft model and from EAGLE-3 heads (which read the target's features over the prompt),
  greedy ones equal to generate; a shared prefix too short to save a prompt bucket is prefilled whole; the
  kept prompt still serves its own repeat afterwards (its caches were copied, not given away); after a
  warm-up nothing is traced; a rest of at most a chunk is not chunked."""
  rng = np.random.default_rng(11)
  words = lambda n: tuple(rng.integers(0, SMALL.vocab_size, n).tolist())
  system = words(20)
  turn1 = system + words(6)  # 26 tokens: bucket 32
  turn2 = turn1 + words(5)  # shares 26 with turn1, 5 left: a chunk of 16
  other = system + words(8)  # shares 20 with turn1 and turn2, 8 left
  short = words(12)
  requests = [Request(turn1, 8), Request(turn2, 8, SamplingConfig(0.9, top_p=0.9), seed=1), Request(other, 8),
              Request(turn2[:29], 6), Request(turn1, 8, SamplingConfig(1.0), seed=2), Request(short, 8),
              Request(short[:2] + words(14), 8)]  # shares 2: its 14 left need bucket 16, as the whole
  proposer = (lambda: DraftModel(draft)) if kind == "draft" else (
      lambda: Eagle(build_heads("eagle3", target.cfg, seed=3, draft_vocab_size=32, d2t=np.arange(0, 64, 2))))
  make = lambda **kw: SlotEngine(target, proposer(), slots=SLOTS, max_len=MAX_LEN, ks=KS, widths=WIDTHS, **kw)
  start = [2 * i for i in range(len(requests))]
  plain = drive(make(), requests, ks=(2, 0), start_at=start)
  engine = make(prompt_cache=8)
  if kind == "draft":  # the warm-up compiles what a prefix start runs: nothing is traced while serving
    engine.warm_up()
  traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
  with backend_compiles() as compiled:
    assert drive(engine, requests, ks=(2, 0), start_at=start) == plain
  if kind == "draft":  # nothing traced, nor compiled (a program traced in the warm-up but not compiled would be)
    assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces
    assert not compiled
  for i in (0, 2, 3, 5, 6):
    assert plain[i] == reference(target, requests[i])
  assert (engine.prefix_hits, engine.prompt_hits, engine.prefills) == (3, 1, 3)
  assert engine.prefix_tokens == len(turn1) + len(system) + 29
  # What a prefix start leaves is what the prompt's own prefill gives: the caches over the prompt, the
  # proposer's state, the target's features over the prompt (the proposals, not only the tokens, are the same).
  for prompt in (turn2, other, turn2[:29]):
    alone = make(prompt_cache=1)
    alone.insert([Request(prompt, 8)])
    for x, y in zip(_prefilled(engine, prompt), _prefilled(alone, prompt), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)

  # Two next turns inserted together into a cache of two: the first's keep drops the second's source, which is
  # then prefilled whole (the same tokens).
  engine = make(prompt_cache=2)
  x, y = Request(turn1, 8), Request(short + words(6), 8)
  for r in (x, y):
    drive(engine, [r])
  together = [Request(turn2, 8), Request(y.prompt + words(4), 8)]
  slots = engine.insert(together)
  out = run_out(engine, slots)
  assert [out[s] for s in slots] == [reference(target, r) for r in together]
  assert (engine.prefix_hits, engine.prefills) == (1, 3)

  # A long prompt prefilled in chunks, then its next turn: at most a chunk left, inserted at once.
  engine = make(prompt_cache=2, prefill_chunk=16)
  first, second = Request(turn1, 8), Request(turn2, 8)
  slot = engine.start_prefill(first)
  while engine.prefill_next() is None:
    pass
  assert run_out(engine, [slot])[slot] == plain[0]
  assert not engine.chunks(second) and engine.chunks(Request(words(40), 8))
  assert drive(engine, [second])[0] == reference(target, second) and engine.prefix_hits == 1


def test_a_max_len_that_is_not_a_power_of_two_prefills_a_prompt_past_its_last_power_at_max_len(target, draft):
  """Slots of 48 positions: a prompt of 36 tokens, whose generate bucket (64) does not fit a slot, is prefilled
  at 48; with a prompt cache a next turn of it starts from its caches, and a repeat of that turn from those;
  greedy tokens equal generate's, and after a warm-up nothing is compiled while serving (the prefill, prefix
  start, chunk, finish and new key at 48 are all in the warm-up)."""
  engine = SlotEngine(target, DraftModel(draft), slots=SLOTS, max_len=48, ks=KS, widths=WIDTHS, prompt_cache=4)
  assert engine.prompt_buckets == (16, 32, 48) and engine.prompt_bucket(36) == 48 and engine.prompt_bucket(9) == 16
  rng = np.random.default_rng(5)
  words = lambda n: tuple(rng.integers(0, SMALL.vocab_size, n).tolist())
  long = words(36)
  turn = long[:30] + words(4)  # shares 30 with long: 4 left, a chunk of 16 (30 + 16 <= 48)
  requests = [Request(long, 8), Request(turn, 8), Request(words(20), 8), Request(turn, 6)]
  engine.warm_up()
  with backend_compiles() as compiled:
    out = drive(engine, requests, ks=(2, 0), start_at=[0, 4, 5, 20])
  assert not compiled
  assert (engine.prefills, engine.prefix_hits, engine.prompt_hits) == (2, 1, 1)
  for i, request in enumerate(requests):
    assert out[i] == reference(target, request), i


def test_prompts_are_padded_to_the_smallest_prompt_bucket_that_holds_them(target, draft):
  """prompt_buckets: a prompt is prefilled padded to the smallest bucket that holds it (and the rest after a
  kept prefix passed at the smallest that holds the rest): greedy tokens equal generate's (which pads to
  powers of two), with a prompt cache too; after a warm-up nothing compiles while serving; the default
  ladder holds the powers of two and the lengths halfway between; bad buckets are refused by name."""
  assert default_prompt_buckets(512) == (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
  assert default_prompt_buckets(300) == (16, 32, 48, 64, 96, 128, 192, 256, 300)
  assert default_prompt_buckets(16) == (16,) and default_prompt_buckets(64) == (16, 32, 48, 64)
  make = lambda **kw: SlotEngine(target, DraftModel(draft), slots=SLOTS, max_len=MAX_LEN, ks=KS, widths=WIDTHS,
                                 prompt_buckets=(24, 40), **kw)
  engine = make(prompt_cache=4)
  assert engine.prompt_buckets == (24, 40, MAX_LEN)
  assert [engine.prompt_bucket(n) for n in (1, 24, 25, 40, 41)] == [24, 24, 40, 40, MAX_LEN]
  rng = np.random.default_rng(8)
  words = lambda n: tuple(rng.integers(0, SMALL.vocab_size, n).tolist())
  first = words(30)
  requests = [Request(first, 8), Request(words(5), 8), Request(words(44), 8),
              Request(first + words(4), 8),  # shares 30: 4 left, passed at 24 (< 40, its own bucket)
              Request(words(20), 8, SamplingConfig(0.9), seed=3)]
  engine.warm_up()
  with backend_compiles() as compiled:
    out = drive(engine, requests, ks=(2, 0), start_at=[0, 0, 0, 6, 6])
  assert not compiled and engine.prefix_hits == 1
  for i, request in enumerate(requests[:4]):
    assert out[i] == reference(target, request), i
  assert drive(make(), requests, ks=(2, 0), start_at=[0, 0, 0, 6, 6]) == out  # no cache: the same tokens
  for bad in ((8,), (MAX_LEN + 1,), ("32",), (True,), 32, "32"):
    with pytest.raises(ValueError, match=r"prompt_buckets must be integers in \[16, max_len=64\]"):
      SlotEngine(target, slots=2, max_len=MAX_LEN, prompt_buckets=bad)


def test_sampling_law_of_a_slot_is_the_targets_whatever_its_neighbours_use():
  """Chi-square against the exact joint law of 2 tokens (V = 12, enumerated): slots with one setting,
  interleaved with slots of other settings in one batch, through speculative rounds (a mismatched draft,
  k = 2: acceptance and correction both happen). The test has power: the same counts fail against a
  neighbour's law."""
  target, draft = make_model(TINY, seed=0), make_model(TINY, seed=5)
  settings = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.6, top_p=0.7),
              SamplingConfig(temperature=1.3, top_k=4), GREEDY]
  slots, rounds, steps = 1024, 32, 2
  engine = SlotEngine(target, DraftModel(draft), slots=slots, max_len=32, ks=(2,), widths=(slots,))
  prompt = (3, 7, 1, 9)
  counts = np.zeros((len(settings),) + (TINY.vocab_size,) * steps)
  accepted = drafted = 0
  for r in range(rounds):
    requests = [Request(prompt, steps, settings[i % len(settings)], seed=r * slots + i) for i in range(slots)]
    out = {i: [] for i in range(slots)}
    for i, slot in enumerate(engine.insert(requests)):
      assert slot == i
    while engine.live_slots:
      result = engine.step(2)
      accepted, drafted = accepted + sum(result.accepted.values()), drafted + sum(result.drafted.values())
      for slot, tokens in result.tokens.items():
        out[slot] += tokens
    for i, tokens in out.items():
      counts[(i % len(settings),) + tuple(tokens)] += 1
  assert 0.05 < accepted / drafted < 0.95
  for s, sampling in enumerate(settings[:3]):
    law = exact_joint(target, sampling, steps, list(prompt))
    assert chi_square_pvalue(counts[s], law) > PASS_P, sampling
  assert chi_square_pvalue(counts[1], exact_joint(target, settings[0], steps, list(prompt))) < 1e-8
  greedy = exact_joint(target, GREEDY, steps, list(prompt))
  assert counts[3][greedy > 0].sum() == counts[3].sum()  # every greedy slot gave the argmax path


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_other_proposers_keep_exactness_across_inserts_and_widths(target, kind):
  """The n-gram lookup and EAGLE-3 heads (state: a token history; a draft cache and features) through
  inserts and width changes: greedy output equals generate alone."""
  proposer = NGram() if kind == "ngram" else Eagle(build_heads("eagle3", target.cfg, seed=3, draft_vocab_size=32,
                                                                d2t=np.arange(0, 64, 2)))
  engine = SlotEngine(target, proposer, slots=2, max_len=MAX_LEN, ks=(2,), widths=(1, 2), shrink_after=1)
  # Two requests, the short one ends (width 1 for the other), then two more (width 2 again).
  requests = [dataclasses.replace(r, sampling=GREEDY, max_new_tokens=n)
              for r, n in zip(random_requests(4, seed=5), (4, 22, 10, 10))]
  widths = []
  out = drive(engine, requests, start_at=[0, 0, 12, 12], widths=widths)
  assert set(widths) == {1, 2}
  for i, r in enumerate(requests):
    assert out[i] == reference(target, r), i


# -------------------------------------------------------------------------------------------- trees

# The tree candidate of the tree tests (one, so that they share its compiled steps): 4 nodes in 2 levels, a
# round writes 5 cache entries (the draft's frontier, 1 + 2, fits in them), so a slot keeps 4 back. Its depth
# is max(KS): the engines' other programs are the chain tests' own.
TREE = DynamicTree(top_k=2, depth=2, nodes=4)


def test_tree_steps_equal_generate_per_request_whatever_shares_the_slots(target, draft):
  """Greedy requests of mixed prompt lengths, output lengths and stop tokens, inserted mid-flight, the state
  moving between widths 1 and 4: stepping only the tree, and mixing tree and chain steps (k = 0 and 2), each
  request equals generate for its prompt alone; the tree steps report the tree, its depth and accepted
  proposals, and a tree round's acceptance can exceed the depth-wise chain's."""
  engine = make_engine(target, draft, trees=(TREE,), shrink_after=2)
  assert engine.candidates == KS + (TREE,) and engine.k_max == 2 and engine.reserve == tree_window(TREE) - 1 == 4
  requests = random_requests(7, seed=21)
  results = []
  for ks, start_at in (((TREE,), [0, 0, 1, 3, 3, 12, 30]), ((TREE, 0, 2, TREE, TREE, 2), [0, 2, 2, 5, 9, 9, 40])):
    widths = []
    out = drive(engine, requests, ks=ks, start_at=start_at, widths=widths, results=results)
    assert set(widths) == set(WIDTHS)
    for i, r in enumerate(requests):
      assert out[i] == reference(target, r), (ks, i)
    assert engine.free_slots == SLOTS and not engine.live_slots
  trees = [r for r in results if r.tree is not None]
  assert {(r.k, r.tree) for r in results} == {(0, None), (2, None), (TREE.depth, TREE.describe())}
  assert sum(sum(r.accepted.values()) for r in trees) > 0
  assert all(r.drafted[s] <= TREE.nodes * r.row_rounds[s] for r in trees for s in r.drafted)
  drafted, rounds = (sum(sum(getattr(r, f).values()) for r in trees) for f in ("drafted", "row_rounds"))
  assert drafted > TREE.depth * rounds  # trees, not chains of their depth: more nodes than levels were verified
  with pytest.raises(ValueError, match="compiled trees"):
    engine.step(TreeShape((2, 1)))
  assert engine.step("dynamic:2,2,4").tree == TREE.describe()  # a tree may be named by its string


def test_the_scheduler_probes_and_runs_the_tree_and_the_metrics_show_it(target, draft):
  """Through the scheduler after warm-up, the policy choosing between plain decoding and the tree (no chain
  k > 0: the engine sizes its state and statistics for the tree's depth): the unmeasured tree is probed (it
  runs), every greedy request equals generate alone, nothing is traced again (a tree step's state feeds the
  k = 0 step's program and back), and /metrics names the tree."""
  from specjax.serving.metrics import ServeMetrics

  engine = make_engine(target, draft, ks=(0,), trees=(TREE,), shrink_after=2)
  assert engine.k_max == TREE.depth
  engine.warm_up()
  times = engine.time_steps(1)
  assert all(set(by_choice) == {0, TREE} for by_choice in times.values())
  scheduler = Scheduler(engine, SpeculationPolicy(times), max_queue=64)
  metrics = ServeMetrics(scheduler)
  scheduler.on_step = metrics.on_step
  traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
  scheduler.start()
  try:
    requests = random_requests(8, seed=22)
    sinks = [Collector() for _ in requests]
    for r, sink in zip(requests, sinks):
      scheduler.submit(Job(r, sink))
    for r, sink in zip(requests, sinks):
      assert sink.done.wait(300) and sink.end.kind == "done"
      assert sink.tokens == reference(target, r)
  finally:
    scheduler.stop()
  assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces
  policy = scheduler.policy
  assert any(c == TREE for _, c in policy.choices)
  view = policy.describe()
  assert TREE.describe() in view["expected_tau"] and view["unmeasured_trees"] == []
  json.dumps(view)
  text = metrics.render().decode()
  assert f'k="{TREE.describe()}"' in text and "specjax_speculation_tree" in text


def test_policy_chooses_among_chains_and_trees_per_width():
  """Synthetic step times and counts: the chains are measured first, then the unmeasured tree is probed
  (even where plain decoding would win); the tree wins where its tau per second is best, k = 0 where nothing
  beats it by the margin, and a tree whose acceptance collapses gives way."""
  tree, zeros = TreeShape((2, 2, 1), max_nodes=5), np.zeros(3)
  policy = SpeculationPolicy({1: {0: 1.0, 2: 1.2, tree: 1.3}, 8: {0: 1.0, 2: 3.0, tree: 6.0}})
  assert policy.candidates == (0, 2, tree) and policy.unmeasured() == 2
  assert policy.choose(1) == 2  # no chain acceptance measured yet: the largest k
  policy.observe(1, 2, 1.2, np.array([8, 6, 0]), np.array([6, 4, 0]))  # E[tau](2) = 1 + 3/4 + 3/4 * 2/3 = 2.25
  assert policy.unmeasured() == tree and policy.choose(8) == tree and policy.decide(1) == tree  # probed at once
  with pytest.raises(ValueError, match="needs accepted= and row_rounds="):
    policy.observe(8, tree, 6.0, zeros, zeros)
  policy.observe(8, tree, 6.0, zeros, zeros, accepted=16, row_rounds=8)  # tau 3
  assert policy.unmeasured() is None and policy.expected_tau(tree) == pytest.approx(3.0)
  assert policy.choose(1) == tree  # 3 / 1.3 > 2.25 / 1.2 > 1 / 1.0
  assert policy.choose(8) == 0  # 3 / 6 and 2.25 / 3 lose to 1 / 1.0
  view = policy.describe()
  assert view["best"] == {1: tree.describe(), 8: 0} and view["expected_tau"][tree.describe()] == pytest.approx(3.0)
  assert json.loads(json.dumps(view))["choices"] == {"1/2": 1, f"1/{tree.describe()}": 1, "8/0": 1,
                                                     f"8/{tree.describe()}": 1}
  for _ in range(300):  # the tree's acceptance collapses: its decayed counts follow
    policy.observe(1, tree, 1.3, zeros, zeros, accepted=0, row_rounds=8)
  assert policy.expected_tau(tree) < 1.01 and policy.decide(1) == 2

  # Trees alone besides k = 0: the tree is measured first, then must beat plain decoding by the margin.
  policy = SpeculationPolicy({4: {0: 1.0, tree: 2.0}}, PolicyConfig(margin=0.05))
  assert policy.choose(4) == tree
  policy.observe(4, tree, 2.0, zeros, zeros, accepted=21, row_rounds=20)  # tau 2.05: 2.5 % faster than k = 0
  assert policy.decide(4) == 0
  policy = SpeculationPolicy({4: {0: 1.0, tree: 2.0}}, PolicyConfig(margin=0.05))
  policy.observe(4, tree, 2.0, zeros, zeros, accepted=24, row_rounds=20)  # tau 2.2: 10 % faster
  assert policy.decide(4) == tree
  with pytest.raises(ValueError, match="same candidates"):
    SpeculationPolicy({1: {0: 1.0, tree: 1.0}, 2: {0: 1.0}})
  with pytest.raises(ValueError, match="candidates"):
    SpeculationPolicy({1: {0: 1.0, "4-2": 1.0}})


def test_tree_candidates_refused_by_field(target, draft):
  """A proposer without trees, a tree too big for max_len, a request that the tree's window leaves no room
  for, strings that are not trees, trees without a proposer, and a fixed k with trees: errors naming it."""
  with pytest.raises(ValueError, match=r"trees\[0\] \(dynamic K=2 D=2 N=4\): method 'ngram' does not propose token"):
    SlotEngine(target, NGram(), slots=2, max_len=MAX_LEN, ks=(0, 2), trees=(TREE,))
  # A round's window: the N + 1 nodes, or a dynamic tree's frontier entries where they are more (1 + 3 * 2).
  assert tree_window(TreeShape((4, 4), max_nodes=16)) == 17 and tree_window(DynamicTree(3, 3, 4)) == 7
  with pytest.raises(ValueError, match=r"trees holds 4-4/16: a round writes up to 17 cache entries .* max_len=16"):
    SlotEngine(target, DraftModel(draft), slots=2, max_len=16, ks=(2,), trees=(TreeShape((4, 4), max_nodes=16),))
  with pytest.raises(ValueError, match=r"trees\[1\]: --tree takes 'dynamic'"):
    SlotEngine(target, DraftModel(draft), slots=2, max_len=MAX_LEN, ks=(2,), trees=("4-2", "wide"))
  with pytest.raises(ValueError, match="trees must be a sequence of tree specs"):
    SlotEngine(target, DraftModel(draft), slots=2, max_len=MAX_LEN, ks=(2,), trees="dynamic")
  with pytest.raises(ValueError, match=r"trees\[0\] must be a specjax.tree.TreeShape"):
    SlotEngine(target, DraftModel(draft), slots=2, max_len=MAX_LEN, ks=(2,), trees=(3,))
  with pytest.raises(ValueError, match="needs a proposer that proposes trees"):
    SlotEngine(target, None, slots=2, max_len=MAX_LEN, trees=(TREE,))
  # The room a request has: max_len less the largest window's reserve (the tree's 4, not k = 2).
  engine = make_engine(target, draft, trees=(TREE,))
  engine.check(Request((1,) * 10, 50))  # 10 + 50 + 4 = 64: exactly full
  with pytest.raises(RequestError, match=r"exceeds the 60 tokens a slot holds \(max_len 64 - 4") as e:
    engine.check(Request((1,) * 10, 51))
  assert e.value.field == "max_new_tokens"
  from specjax.serving.server import build_server

  with pytest.raises(ValueError, match="trees are candidates of k='auto' only"):
    build_server(target, ByteTokenizer(), DraftModel(draft), name="t", k=2, trees=(TREE,), warm_up=False)
  with pytest.raises(ValueError, match="trees need a proposer"):
    build_server(target, ByteTokenizer(), None, name="t", trees=(TREE,), warm_up=False)
  from specjax.serving.server import Limits

  with pytest.raises(ValueError, match=r"Limits.max_n \(3\) must be at most slots \(2\)"):
    build_server(target, ByteTokenizer(), None, name="t", slots=2, limits=Limits(max_n=3), warm_up=False)
  with pytest.raises(ValueError, match="launch_ahead must be True, False or None"):
    build_server(target, ByteTokenizer(), None, name="t", slots=2, launch_ahead="yes", warm_up=False)


def test_engine_refuses_what_does_not_fit_by_field(target, draft):
  engine = make_engine(target, draft)  # room for prompt + max tokens: 64 - 2
  cases = [(Request((), 4), "prompt", "empty"), (Request((1, 999), 4), "prompt", "outside the vocabulary"),
           (Request((1,), 0), "max_new_tokens", ">= 1"), (Request((1,) * 10, 53), "max_new_tokens", "exceeds"),
           (Request((1,) * 70, 1), "prompt", "exceeds"),
           (Request((1,), 2, stop_ids=(1, 2, 3, 4, 5)), "stop_ids", "at most"),
           (Request((1,), 2, stop_ids=(64,)), "stop_ids", "outside the vocabulary"),
           (Request((1,), 2, seed=1.5), "seed", "integer")]
  for request, field, message in cases:
    with pytest.raises(RequestError, match=message) as e:
      engine.check(request)
    assert e.value.field == field
  engine.check(Request((1,) * 10, 52))  # exactly full
  for kwargs, message in ((dict(slots=0), "slots must be"), (dict(max_len=8), r"max_len must be an integer in \[16"),
                          (dict(ks=(0, 2)), "needs a proposer"), (dict(slots=4, widths=(1, 3)), "widths must")):
    with pytest.raises(ValueError, match=message):
      SlotEngine(target, None, **kwargs)
  with pytest.raises(ValueError, match="compiled speculation lengths"):
    engine.step(3)


# ------------------------------------------------------------------------------------------- policy


def test_policy_picks_k_by_width_and_falls_back_where_speculation_loses():
  """Narrow steps are cheap (speculation pays), wide ones dear (plain decoding wins), with the same
  acceptance; acceptance that collapses makes every width fall back to k = 0."""
  reached, accepted = np.array([8, 7, 6, 5]), np.array([7, 6, 5, 4])  # high acceptance
  policy = SpeculationPolicy({1: {0: 1.0, 1: 1.1, 2: 1.2, 4: 1.4}, 8: {0: 2.0, 1: 5.0, 2: 8.0, 4: 14.0}})
  assert policy.choose(1) == 4 and policy.choose(8) == 4  # no acceptance measured yet: measure at the largest k
  policy.observe(1, 4, 1.4, reached, accepted)
  assert policy.expected_tau(4) > 3
  assert policy.decide(1) == 4 and policy.decide(8) == 0
  for _ in range(300):
    policy.observe(1, 4, 1.4, np.array([8, 0, 0, 0]), np.zeros(4))
  assert policy.decide(1) == 0
  # Costs follow the measured steps: a width whose speculative steps turn out cheap starts to speculate.
  for _ in range(32):
    policy.observe(8, 1, 2.1, np.array([8, 0, 0, 0]), np.array([8, 0, 0, 0]))
  assert policy.decide(8) == 1
  with pytest.raises(ValueError, match="same candidates"):
    SpeculationPolicy({1: {0: 1.0, 2: 1.0}, 2: {0: 1.0}})
  with pytest.raises(ValueError, match="timed widths"):
    policy.choose(3)


def test_start_up_timings_give_way_to_the_first_measured_step():
  """Start-up timings time the general program on empty rows; once a candidate has run at a width, its measured
  steps alone give its cost there: a pessimistic start-up timing of plain decoding does not keep a k that a
  measured plain step beats (with the start-up timing in the median it would: (2.0 + 0.8) / 2 > 1.5 / tau)."""
  policy = SpeculationPolicy({8: {0: 2.0, 2: 2.4}})
  policy.observe(8, 2, 1.5, np.array([8, 6]), np.array([4, 2]))  # E[tau](2) = 1 + 1/2 + 1/2 * (2 + 8/2) / (6 + 8)
  assert policy.expected_tau(2) == pytest.approx(1 + 0.5 + 0.5 * 6 / 14) and policy.step_seconds(8, 2) == 1.5
  assert policy.step_seconds(8, 0) == 2.0 and policy.decide(8) == 2  # 1.14 tokens/s against 0.5
  policy.observe(8, 0, 0.8, np.zeros(2), np.zeros(2))
  assert policy.step_seconds(8, 0) == 0.8 and policy.decide(8) == 0  # 1.25 against 1.14
  policy.observe(8, 0, 1.2, np.zeros(2), np.zeros(2))
  assert policy.step_seconds(8, 0) == pytest.approx(1.0)  # the median of the measured steps
  policy.observe(8, 2, None, np.array([8, 8]), np.array([8, 8]))  # no timing (a program's first run)
  assert policy.step_seconds(8, 2) == 1.5 and policy.expected_tau(2) > 1 + 0.5 + 0.5 * 6 / 14  # its acceptance counts


def test_a_deeper_position_seen_in_a_few_probe_rounds_is_read_as_the_one_before_until_its_k_runs():
  """The acceptance past the first position gets a prior at the position before it: an unlucky probe (0 of 4
  at position 1, where 0.6 holds) no longer keeps k = 1 running where k = 2 is faster; once k = 2 runs, its
  measured acceptance takes over (the estimate converges to it, low or high), and the prior's weight is a
  setting (0: the measured ratio alone, which shows the failure)."""
  times = {1: {0: 1.0, 1: 1.5, 2: 1.7}}
  rng = np.random.default_rng(0)

  def run_k1(policy, steps=200):
    for _ in range(steps):  # 8 row-rounds a step, position 0 accepted at 0.8
      policy.observe(1, 1, 1.5, np.array([8, 0]), np.array([rng.binomial(8, 0.8), 0]))

  def rates(policy):
    return {k: policy.rate(1, k) for k in (0, 1, 2)}

  for config, expect in ((PolicyConfig(), 2), (PolicyConfig(prior_rounds=0), 1)):
    policy = SpeculationPolicy(times, config)
    policy.observe(1, 2, 1.7, np.array([5, 4]), np.array([4, 0]))  # the probe: d_1 never accepted
    run_k1(policy)
    assert policy.decide(1) == expect, (config, rates(policy), policy.acceptance_by_position())
  # Measured acceptance wins over the prior once its k runs: 0.2 at position 1 makes k = 2 lose again.
  policy = SpeculationPolicy(times)
  for _ in range(200):
    policy.observe(1, 2, 1.7, np.array([8, 6]), np.array([6, rng.binomial(6, 0.2)]))
  assert policy.acceptance_by_position()[1] == pytest.approx(0.2, abs=0.06)
  assert policy.measured_acceptance()[1] == pytest.approx(0.2, abs=0.06) and policy.decide(1) == 1
  for bad in (-1, float("inf"), True, "8"):
    with pytest.raises(ValueError, match="prior_rounds must be"):
      PolicyConfig(prior_rounds=bad)


def test_probes_go_first_to_candidates_without_a_measured_step_at_the_width():
  """A candidate whose steps at a width were all untimed keeps its start-up timing; the next probes go to it
  (not in turn) until one of its steps is timed, then rotate."""
  policy = SpeculationPolicy({1: {0: 4.0, 1: 3.0, 2: 3.5, 4: 5.0}}, PolicyConfig(probe_every=2, probe_max=2, probe_budget=1.0))
  policy.observe(1, 4, 3.0, np.array([8, 8, 8, 8]), np.array([8, 6, 4, 2]))
  for k in (1, 2):
    policy.observe(1, k, 2.0, np.zeros(4), np.zeros(4))
  probes = []
  for _ in range(12):
    choice = policy.choose(1)
    if choice != policy.best[1]:
      probes.append(choice)
      policy.observe(1, choice, None if len(probes) < 3 else 1.0, np.zeros(4), np.zeros(4))
  assert probes[:3] == [0, 0, 0] and len(set(probes)) > 1  # untimed twice, timed the third time, then in turn


def test_start_up_timings_run_live_rows_in_calls_of_several_rounds_and_leave_the_engine_empty(target, draft):
  """time_steps times each width with every row live and calls of the engine's rounds (empty rows time one
  round and the call's fixed cost), and leaves nothing behind: the engine empty at its first width, its
  counters as before, and requests served after it equal to generate alone."""
  engine = make_engine(target, draft, rounds=4)
  engine.warm_up()
  counters, calls, step = (engine.prefills, engine.copies), [], engine.step

  def spy(choice, rounds=1):
    live = len(engine.live_slots)
    result = step(choice, rounds)
    calls.append((result.width, choice, live, rounds, result.rounds))
    return result
  engine.step = spy
  times = engine.time_steps(2)
  del engine.step
  assert set(times) == set(WIDTHS) and all(set(t) == set(KS) and min(t.values()) > 0 for t in times.values())
  assert sorted((w, c) for w, c, *_ in calls) == sorted((w, c) for w in WIDTHS for c in KS for _ in range(2))
  assert all(live == width and asked == ran == 4 for width, _, live, asked, ran in calls), calls
  assert engine.live_slots == [] and engine.free_slots == SLOTS and engine.width == WIDTHS[0]
  assert (engine.prefills, engine.copies) == counters
  requests = random_requests(3, seed=5)
  out = drive(engine, requests, ks=(2, 0))
  assert [out[i] for i in range(3)] == [reference(target, r) for r in requests]


def test_untimed_probes_do_not_lengthen_the_probe_interval():
  """While a probe brings no timing (a program's first run, a one-round call), the next comes after the same
  interval: doubling it then left plain decoding at its start-up timing for 216 calls on the bundled pair. Once
  timed, the interval doubles again."""
  policy = SpeculationPolicy({1: {0: 4.0, 1: 3.0}}, PolicyConfig(probe_every=4, probe_max=64, probe_budget=1.0))
  policy.observe(1, 1, 3.0, np.array([8]), np.array([6]))  # k = 1 wins on the start-up timings
  probes, timed_from = [], 4
  for i in range(200):
    choice = policy.choose(1)
    if choice == 0:
      probes.append(i)
      policy.observe(1, 0, 10.0 if len(probes) > timed_from else None, np.zeros(1), np.zeros(1))
    else:
      policy.observe(1, 1, 3.0, np.array([1]), np.array([1]))
  gaps = np.diff(probes).tolist()
  assert gaps[:timed_from + 1] == [4] * (timed_from + 1) and gaps[timed_from + 1:timed_from + 4] == [8, 16, 32]


def test_a_probe_due_on_an_untimed_step_waits_for_the_next_timed_one():
  """choose(width, timed=False) (the scheduler's one-round calls) never probes: a probe that falls due then
  runs on the next timed step, and the probes' schedule is otherwise the same as with every step timed."""
  def run(untimed: set[int]) -> list[int]:
    policy = SpeculationPolicy({4: {0: 1.0, 2: 5.0}}, PolicyConfig(probe_every=4, probe_max=16, probe_budget=1.0))
    policy.observe(4, 2, 5.0, np.array([8, 4]), np.array([2, 1]))
    picks = []
    for i in range(64):
      picks.append(policy.choose(4, timed=i not in untimed))
      policy.observe(4, picks[-1], 1.0 if picks[-1] == 0 else 5.0, np.zeros(2), np.zeros(2))
    return [i for i, k in enumerate(picks) if k == 2]

  every = run(set())
  assert every[:3] == [3, 11, 27]
  untimed = {3, 4, 5, 14}  # the first probe falls due at 3 (then 4, 5), the second at 6 + 8 = 14
  probes = run(untimed)
  assert not set(probes) & untimed
  assert probes[:3] == [6, 15, 31]  # each on the next timed step; the interval doubles from there


def test_probing_keeps_to_its_budget_far_from_the_best_and_probes_a_close_candidate_at_the_interval():
  """A candidate predicted to deliver a fraction d less than the best is probed at most every d / probe_budget
  steps (so probes cost at most about probe_budget of the throughput), one close to the best at the doubling
  interval; without probe_budget's limit (1.0) the far one is probed at the interval too; a bad budget is
  refused by name."""
  def probes(cost: float, budget: float, steps: int = 400) -> list[int]:
    # k = 2 at E[tau] 1.5 (acceptance 0.5 then 0.0): its rate is 1.5 / cost of plain decoding's 1 / 1.0.
    policy = SpeculationPolicy({8: {0: 1.0, 2: cost}}, PolicyConfig(probe_every=4, probe_max=16,
                                                                     probe_budget=budget, prior_rounds=0))
    policy.observe(8, 2, cost, np.array([8, 4]), np.array([4, 0]))
    picks = []
    for _ in range(steps):
      picks.append(policy.choose(8))
      policy.observe(8, picks[-1], 1.0 if picks[-1] == 0 else cost, np.array([8, 4]), np.array([4, 0]))
    return [i for i, k in enumerate(picks) if k == 2]

  far = probes(3.0, 0.01)  # rate 0.5 of plain: d = 0.5, at most one probe per 50 steps
  assert far and min(np.diff([-1] + far)) >= 50 and len(far) <= 400 // 50
  loss = sum(1 - 0.5 for _ in far) / 400  # each probe step delivers d less than a plain one
  assert loss <= 0.01 + 1e-9
  close = probes(1.6, 0.01)  # rate 0.94 of plain: d = 0.0625, one probe per 6.25 steps allowed
  assert close[0] == 6 and np.diff(close[:4]).tolist() == [8, 16, 16]  # the 7th step: 7 * 0.01 >= 0.0625
  assert np.diff(probes(3.0, 1.0)[:3]).tolist() == [8, 16]  # no budget: the interval alone
  for bad in (0, -0.1, 1.5, True, float("nan")):
    with pytest.raises(ValueError, match="probe_budget"):
      PolicyConfig(probe_budget=bad)


def test_a_probe_timed_in_a_slow_spell_is_read_against_the_best_of_the_same_moment():
  """The machine's speed drifts; a probe is costed by its ratio to the best's steps of the same moment, so a
  spell that slows every step alike does not turn the probe's candidate away. k = 1 costs 1.5 rounds of plain
  decoding and delivers E[tau] = 1.8: 1.2x plain decoding at any speed. Plain decoding runs (the start-up
  timings favour it); the machine slows 2x for four of its steps and the probe of k = 1; it recovers. Paired,
  k = 1 is costed 1.5 rounds of plain decoding and wins; unpaired, its 3.0 against plain decoding's 1.0 loses
  (the failure pairing removes). With k = 1 running, plain decoding's stale steps are costed through the
  inverse ratio."""
  reached, accepted = np.array([10]), np.array([8])  # position 0 accepted at 0.8: E[tau](1) = 1.8
  for paired, expect in ((True, 1), (False, 0)):
    policy = SpeculationPolicy({8: {0: 1.0, 1: 2.0}}, PolicyConfig(paired=paired))
    policy.observe(8, 1, None, reached, accepted)  # acceptance measured (a cold step: no timing)
    assert policy.choose(8) == 0
    for m in [1.0] * 20 + [2.0] * 4:
      policy.observe(8, 0, 1.0 * m, np.zeros(1), np.zeros(1))
    policy.observe(8, 1, 1.5 * 2.0, reached, accepted)  # the probe, in the slow spell
    for _ in range(20):
      policy.observe(8, 0, 1.0, np.zeros(1), np.zeros(1))
    assert policy.step_seconds(8, 1) == pytest.approx(1.5 if paired else 3.0)
    assert policy.decide(8) == expect, policy.describe()
  # k = 1 now runs (paired); plain decoding is costed against it by the inverse of k = 1's ratio to it.
  policy = SpeculationPolicy({8: {0: 1.0, 1: 2.0}})
  policy.observe(8, 1, None, reached, accepted)
  policy.choose(8)
  for m in [1.0] * 4 + [2.0] * 4:
    policy.observe(8, 0, 1.0 * m, np.zeros(1), np.zeros(1))
  policy.observe(8, 1, 3.0, reached, accepted)
  assert policy.choose(8) == 1 and policy.best[8] == 1
  for _ in range(8):
    policy.observe(8, 1, 1.2, reached, accepted)  # the machine got faster still
  assert policy.step_seconds(8, 1) == pytest.approx(1.2) and policy.step_seconds(8, 0) == pytest.approx(0.8)
  assert policy.own_seconds(8, 0) == 1.5  # its own steps: half of them in the slow spell
  assert policy.describe()["ratios_to_best"] == {}  # none of a candidate to k = 1 yet (0 has the inverse)
  for bad in ({"paired": 1}, {"pair_steps": 0}, {"pair_window": 1.5}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      PolicyConfig(**bad)


def test_paired_costs_follow_the_best_candidate_through_a_drifting_machine():
  """A closed loop of choose and observe on a machine whose speed drifts (a slow spell of a random length every
  so often, 1.5-2.5x): true costs plain 1.0, k = 1 1.5, k = 2 2.2 times the speed, acceptance 0.8 then 0.5
  (E[tau] 1.8 and 2.2: k = 1 is the best at 1.2x plain decoding, k = 2 at 1.0x). Paired, the policy runs k = 1
  in at least 95 % of the steps after the first 200, on each of four machines (seeds); unpaired, drift makes it
  run another candidate more often (measured: 98 % paired on every seed, 78-94 % unpaired)."""
  def run(paired: bool, seed: int) -> float:
    rng = np.random.default_rng(seed)
    policy = SpeculationPolicy({8: {0: 1.0, 1: 1.5, 2: 2.2}}, PolicyConfig(paired=paired, probe_every=8,
                                                                         probe_max=64))
    cost, speed, spell = {0: 1.0, 1: 1.5, 2: 2.2}, 1.0, 0
    picks = []
    for _ in range(3000):
      if spell == 0 and rng.random() < 0.02:
        spell, speed = int(rng.integers(5, 60)), float(rng.uniform(1.5, 2.5))
      spell = max(spell - 1, 0)
      k = policy.choose(8)
      picks.append(k)
      proposed = np.arange(2) < k  # the positions k proposals reach: 8 rows, accepted at 0.8 then 0.5
      reached, accepted = np.array([8.0, 6.4]) * proposed, np.array([6.4, 3.2]) * proposed
      seconds = cost[k] * (speed if spell else 1.0) * float(rng.uniform(0.97, 1.03))
      policy.observe(8, k, seconds, reached, accepted)
    return float(np.mean(np.array(picks[200:]) == 1))

  paired, unpaired = [run(True, seed) for seed in range(4)], [run(False, seed) for seed in range(4)]
  assert min(paired) >= 0.95 and np.mean(unpaired) <= np.mean(paired) - 0.05, (paired, unpaired)


def test_policy_probes_other_candidates_less_and_less_often():
  policy = SpeculationPolicy({4: {0: 1.0, 2: 5.0}}, PolicyConfig(probe_every=4, probe_max=16, probe_budget=1.0))
  policy.observe(4, 2, 5.0, np.array([8, 4]), np.array([2, 1]))
  picks = [policy.choose(4) for _ in range(64)]
  probes = [i for i, k in enumerate(picks) if k == 2]
  gaps = np.diff(probes)
  assert len(probes) >= 3 and gaps[0] < gaps[-1] <= 16


# --------------------------------------------------------------------------------------------- text


TEXTS = ["naïve café – 日本語 🙂 and e\u0301", "def f(x):\n    return x ** 2  # ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🙂🙃" * 5]


def pieces_of(tok, ids: list[int], rng) -> list[str]:
  """What a TextStream emits for ``ids`` pushed in random chunks of 1 to 3, ``finish()`` last."""
  stream_ = TextStream(tok)
  pieces, i = [], 0
  while i < len(ids):
    n = int(rng.integers(1, 4))
    pieces.append(stream_.push(ids[i:i + n]))
    i += n
  return pieces + [stream_.finish()]


@pytest.mark.parametrize("name", ["bytes", "byte-level BPE (bytes)", "byte-level BPE (trained)"])
def test_text_stream_emits_only_stable_text(name):
  """Pieces never hold half a UTF-8 character or a token decoded without its left context, and join to
  the decoded text, for any chunking of the ids; random ids (often invalid UTF-8) join to their decoding
  too, however the invalid bytes fall between pieces."""
  tok = {"bytes": ByteTokenizer, "byte-level BPE (bytes)": byte_level_tokenizer,
         "byte-level BPE (trained)": lambda: load_tokenizer(specjax.pretrained.ASSETS / "stdlib-coder")}[name]()
  rng = np.random.default_rng(0)
  for text in TEXTS:
    ids = tok.encode(text)
    for _ in range(5):
      pieces = pieces_of(tok, ids, rng)
      assert "".join(pieces) == tok.decode(ids) == text
      assert not any("\ufffd" in p for p in pieces)
  vocab = min(tok.vocab_size, 256) if name == "bytes" else tok.vocab_size
  for _ in range(30):
    ids = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
    assert "".join(pieces_of(tok, ids, rng)) == tok.decode(ids)


def test_text_stream_holds_incomplete_and_invalid_bytes_until_they_are_final():
  text = TextStream(ByteTokenizer())
  assert text.push([0xE6]) == "" and text.push([0x97]) == ""  # the start of a 3-byte character: wait
  assert text.push([0xA5, ord("!")]) == "日!"
  assert text.push([0xFF]) == "" and text.push([0xE6, 0x97]) == ""  # invalid, then incomplete: wait
  assert text.push([ord("a")]) == "\ufffd\ufffda"  # what b"\xff\xe6\x97a" decodes to
  assert text.push([0xF0]) == "" and text.finish() == "\ufffd"  # cut short: what the bytes decode to
  assert text.text == ByteTokenizer().decode([0xE6, 0x97, 0xA5, ord("!"), 0xFF, 0xE6, 0x97, ord("a"), 0xF0])


def test_stop_strings_cut_at_the_first_and_hold_back_possible_starts():
  s = StopStrings(["\n\n", "END"])
  assert s.push("hello E") == "hello "  # "E" may start "END"
  assert s.push("xit\n") == "Exit"  # "\n" may start "\n\n"
  assert s.push("\nmore") == "" and s.stopped  # "\n\n" found: nothing after "Exit"
  assert s.push("after") == "" and s.finish() == ""
  u = StopStrings(["END"])
  assert u.push("abcENDxyz") == "abc" and u.stopped
  t = StopStrings(["END"])
  assert t.push("the EN") == "the " and t.finish() == "EN"


# ------------------------------------------------------------------------------------------- stream


def test_stream_yields_the_generate_output(target, draft):
  """Token ids round by round (k = "auto": the policy picks k per round) that equal generate's output,
  and text pieces that join to the decoded output, from a model whose random bytes are often invalid
  UTF-8 (the pieces hold back incomplete characters)."""
  request = Request(prompt=(5, 1, 7, 7, 2, 9, 9, 4, 1, 3), max_new_tokens=REF_NEW)
  rounds = list(stream(target, list(request.prompt), draft=draft, spec=SpecConfig(k="auto", k_max=2),
                       max_new_tokens=REF_NEW))
  assert sum(rounds, []) == reference(target, request) and len(rounds) > 1
  tok = ByteTokenizer()
  byte_model = make_model(dataclasses.replace(SMALL, vocab_size=tok.vocab_size), seed=3)
  ids = sum(stream(byte_model, tok.encode("héllo wörld"), max_new_tokens=40, eos_id=tok.eos_id), [])
  pieces = list(stream(byte_model, "héllo wörld", tokenizer=tok, max_new_tokens=40))
  assert "".join(pieces) == tok.decode(ids) and len(pieces) > 1
  assert any(t >= 0x80 for t in ids)  # the case the test is about: bytes of multi-byte or invalid sequences
  with pytest.raises(ValueError, match="stream takes one prompt"):
    stream(target, [[1], [2]])
  with pytest.raises(ValueError, match="max_new_tokens must be"):
    stream(target, [1], max_new_tokens=0)


# ------------------------------------------------------------------------------------------ scheduler


class Collector:
  """A request sink that keeps every event and signals the end."""

  def __init__(self, fail_on_tokens: bool = False):
    self.tokens, self.end, self.done = [], None, threading.Event()
    self.fail_on_tokens = fail_on_tokens

  def __call__(self, event: Event):
    if event.kind == "tokens":
      if self.fail_on_tokens:
        raise RuntimeError("the client's sink broke")
      self.tokens += event.tokens
    else:
      self.end = event
      self.done.set()


def fixed_policy(engine: SlotEngine) -> SpeculationPolicy:
  return SpeculationPolicy({w: {0: 1.0, 2: 1.5} for w in engine.widths})


def test_a_request_that_fails_fails_alone(target, draft):
  engine = make_engine(target, draft)
  scheduler = Scheduler(engine, fixed_policy(engine), max_queue=8).start()
  try:
    requests = random_requests(6, seed=3)
    sinks = [Collector(fail_on_tokens=(i == 2)) for i in range(len(requests))]
    for r, sink in zip(requests, sinks):
      scheduler.submit(Job(r, sink))
    for sink in sinks:
      assert sink.done.wait(120)
    assert sinks[2].end.kind == "error" and "sink broke" in sinks[2].end.error
    for i, (r, sink) in enumerate(zip(requests, sinks)):
      if i != 2:
        assert sink.end.kind == "done" and sink.end.reason in ("stop", "length")
        assert sink.tokens == reference(target, r)
  finally:
    scheduler.stop()
  assert engine.free_slots == SLOTS and not scheduler.alive


def test_queue_bound_cancellation_and_stop(target, draft):
  """Submitted before the thread starts, requests wait; past the bound they are refused; a cancelled one
  ends as cancelled; after stop nothing is taken."""
  engine = make_engine(target, draft)
  scheduler = Scheduler(engine, fixed_policy(engine), max_queue=2)
  first, second = Job(Request((1, 2, 3), 20), Collector()), Job(Request((4,), 5), Collector())
  scheduler.submit(first)
  scheduler.submit(second)
  with pytest.raises(QueueFull, match="2 requests are waiting"):
    scheduler.submit(Job(Request((5,), 5), Collector()))
  scheduler.cancel(first)
  scheduler.start()
  assert first.sink.done.wait(60) and second.sink.done.wait(60)
  assert first.sink.end.reason == "cancelled" and first.sink.tokens == []
  assert second.sink.end.reason == "length" and len(second.sink.tokens) == 5
  scheduler.stop()
  with pytest.raises(ShuttingDown):
    scheduler.submit(Job(Request((5,), 5), Collector()))


def _rss_kib() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() // 1024


def test_no_recompilation_and_flat_memory_over_many_requests(target, draft):
  """300 requests of every prompt bucket, output length and setting through the scheduler after warm-up,
  the state moving between widths: no program is traced or compiled again, and the resident memory does not
  keep growing."""
  engine = make_engine(target, draft, shrink_after=2)
  engine.warm_up()
  scheduler = Scheduler(engine, SpeculationPolicy(engine.time_steps(2)), max_queue=1000).start()
  try:
    traces = {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")}
    rss = []
    with backend_compiles() as compiled:
      for batch in range(3):
        requests = random_requests(99, seed=10 + batch, max_prompt=40, max_new=20, sampled_every=4)
        for start in range(0, len(requests), 33):  # a burst, then two long requests, then one: widths 4 and 1
          burst, pair = requests[start:start + 30], requests[start + 30:start + 32]
          single = requests[start + 32:start + 33]
          for group in (burst, [dataclasses.replace(r, max_new_tokens=20, stop_ids=()) for r in pair],
                        [dataclasses.replace(r, max_new_tokens=20, stop_ids=()) for r in single]):
            sinks = [Collector() for _ in group]
            for r, sink in zip(group, sinks):
              scheduler.submit(Job(r, sink))
            for sink in sinks:
              assert sink.done.wait(120) and sink.end.kind == "done"
        rss.append(_rss_kib())
    assert {k: v for k, v in TRACE_COUNTS.items() if k.startswith("serve")} == traces
    assert not compiled
    assert {w for w, _ in scheduler.policy.choices} == set(engine.widths)
    assert rss[2] - rss[1] < 32 * 1024, rss  # KiB
  finally:
    scheduler.stop()
