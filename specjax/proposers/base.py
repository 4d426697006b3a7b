"""The proposer protocol: what the speculative round asks of anything that guesses tokens.

A proposer is a frozen dataclass (static under ``jax.jit``, like gemma's ``SamplingMethod`` or
tpu-inference's ``Eagle3Proposer``) with three pure methods over a pytree state of its own:

- ``init(target, prompts, prompt_lens, features, max_len) -> state``, once after the target's prefill;
- ``propose(state, target, ctx, keys, k, sampler, steps) -> Proposal``: ``k`` tokens per row and the
  distributions ``q`` they were drawn from (warped by the round's :class:`~specjax.sampling.Sampler`, which
  counts the proposals before each position), at the start of each round;
- ``commit(state, target, verified) -> state``, after verification, with what was accepted and the
  target's features of the verified window. It also follows rounds in which the proposer proposed
  nothing (a server's k = 0 rounds: the window is ``[last]``, ``num_drafts = 0``), so that its state keeps
  up with the context whatever k each round used.

The round calls these and nothing proposer-specific. Proposals are exact under the one acceptance rule as
long as ``q`` is the distribution each token was really drawn from (one-hot for a deterministic proposal,
zero outside a reduced draft vocabulary): the engine never recomputes it.

Parameters are not part of the static object: the fields named in ``module_fields`` hold Flax NNX
modules, which the host API splits once (``split``) and the jitted program merges back inside the trace
(``bind``), so a proposer with the same structure and new weights reuses the compiled program.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax

from specjax.sampling import Sampler


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Features:
  """What one target pass exposes to proposers, per position of the pass.

  Attributes:
    hidden: ``[B, T, D]`` the final-norm hidden state (the LM head's input).
    aux: ``[B, T, len(aux_layers) * D]`` the residual streams entering the proposer's ``aux_layers``,
      concatenated; None when it reads none.
  """

  hidden: jax.Array
  aux: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
  """Where each row stands at the start of a round.

  Attributes:
    last: ``[B] int32`` the newest accepted token, in no cache yet.
    lengths: ``[B] int32`` the target cache's lengths: ``last`` sits at position ``lengths``.
    active: ``[B] bool`` rows still generating (finished rows' proposals are ignored).
  """

  last: jax.Array
  lengths: jax.Array
  active: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
  """The outcome of one round, handed to :meth:`Proposer.commit`.

  Attributes:
    window: ``[B, k+1]`` the tokens the target scored, ``[last, d_1..d_k]``, at positions
      ``lengths .. lengths + k``.
    emitted: ``[B, k+1]`` ``d_1..d_n, token`` then the rejected proposals: the row's context continues
      with ``emitted[:, :n+1]`` at positions ``lengths + 1 ..``.
    n: ``[B] int32`` accepted proposals; ``emitted[b, n[b]]`` is the new ``last``.
    num_drafts: ``[] int32`` proposals per row this round (k, or fewer under a dynamic schedule).
    active: ``[B] bool`` rows that generated this round (the others' outputs are to be ignored).
    lengths: ``[B] int32`` target cache lengths before the round.
    new_lengths: ``[B] int32`` after it: ``lengths + n + 1`` for active rows, unchanged otherwise.
    features: the target's :class:`Features` at the window's ``k + 1`` positions.
  """

  window: jax.Array
  emitted: jax.Array
  n: jax.Array
  num_drafts: jax.Array
  active: jax.Array
  lengths: jax.Array
  new_lengths: jax.Array
  features: Features


class Proposal(NamedTuple):
  """What :meth:`Proposer.propose` returns.

  Attributes:
    drafts: ``[B, k] int32`` the proposed tokens.
    q: ``[B, k, V] float32`` the warped distribution each draft was drawn from.
    state: the proposer's updated state.
    extra_steps: ``[] int32`` proposer passes spent this round besides the k proposals (the draft model's
      catch-up step); counted in the run's statistics and costed by the cost model.
    limit: ``[B] int32`` in ``[0, k]``, or None (all k): how many of the row's proposals are proposals at all
      (suffix decoding proposes as many tokens as its match supports). The engine masks the rest in
      acceptance (``q = 0`` there, so the row's next token comes from ``p`` after its last proposal).
    score: ``[B] float32``, or None: the proposer's own estimate of how many of the row's proposals the
      target will accept (suffix decoding: the sum of its path probabilities), read by
      :class:`~specjax.proposers.Combined` to choose among proposers per row.
  """

  drafts: jax.Array
  q: jax.Array
  state: Any
  extra_steps: jax.Array
  limit: jax.Array | None = None
  score: jax.Array | None = None


class TreeProposal(NamedTuple):
  """What :meth:`Proposer.propose_tree` returns.

  Attributes:
    tree: the rows' :class:`specjax.tree.Tree` (slot 0 the root, ``last``).
    q: ``[B, N + 1, V]`` the law each slot's children were drawn from (sampled selections), or None.
    state: the proposer's updated state. extra_steps, score: as in :class:`Proposal`.
  """

  tree: Any
  q: jax.Array | None
  state: Any
  extra_steps: jax.Array
  score: jax.Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Proposer(abc.ABC):
  """Base class of every proposer (see the module docstring for the contract).

  Class attributes a subclass sets:
    name: the method name (``specjax generate --method NAME``).
    module_fields: the dataclass fields that hold NNX modules (parameters); the others are static options.
    scores_proposals: ``propose`` returns :attr:`Proposal.score`, computed from the context and the
      proposer's state alone (never from the round's random draws), so that a
      :class:`~specjax.proposers.Combined` may choose by it.
    catch_up: a fully accepted round costs one more proposer step at the start of the next round (the draft
      model, which never saw its own last proposal; with a tree, a round whose last accepted node it never
      expanded: a node of the deepest level); the cost model adds it with probability P(all accepted).
    may_skip_propose: :meth:`commit` keeps the state correct after a chain round in which :meth:`propose` was
      not called (the state as the previous commit left it), so a :class:`~specjax.proposers.Combined`
      that chose another member for every row skips this member's proposals that round. Every built-in
      proposer can (a draft model catches up on what it skipped before its next proposals); the default is
      False, for proposers of the user's own whose commit reads what propose wrote.
    plain_rounds_keep_caches: :meth:`commit` after a round without proposals (k = 0) leaves every KV cache of
    the state as it was (it may move lengths and write other arrays): a server's plain-decoding steps then
    need not cut the proposer's caches to their attention length and write them back
    (:class:`~specjax.serving.slots.SlotEngine`). The draft model's and the parallel draft's (they catch up
    before their next proposals), and, trivially, those that hold no KV cache (n-gram, suffix, Medusa), so
    that a :class:`~specjax.proposers.Combined` of such members keeps its draft's caches whole too; False
    by default.
  """

  name: ClassVar[str] = ""
  module_fields: ClassVar[tuple[str, ...]] = ()
  catch_up: ClassVar[bool] = False
  scores_proposals: ClassVar[bool] = False
  may_skip_propose: ClassVar[bool] = False
  plain_rounds_keep_caches: ClassVar[bool] = False

  # ------------------------------------------------------------------------------ static description

  @property
  def aux_layers(self) -> tuple[int, ...]:
    """Target layers whose incoming residual streams the proposer reads (static); () for none."""
    return ()

  @property
  def varies_limit(self) -> bool:
    """Whether :meth:`propose` may return a per-row :attr:`Proposal.limit` below k; the engine then verifies
    each round over the shortest of a few windows that holds every row's proposals
    (:func:`specjax.engine.verify_bucketed`) instead of always k + 1 tokens."""
    return False

  def verify_widths(self, k: int) -> tuple[int, ...] | None:
    """The proposal counts, ascending and ending at ``k``, whose windows the engine compiles for a round of
    ``k`` when :attr:`varies_limit`; None: :func:`specjax.engine.verify_widths`'s few (1, 2, 4, 8, ... and
    k + 1 tokens). A proposer whose limits are often just below k (a confidence cutoff) asks for every one."""
    return None

  @property
  def max_k(self) -> int | None:
    """The largest number of proposals per round it can make (Medusa: its head count); None: any."""
    return None

  def options(self) -> tuple:
    """The static options, as ``(name, value)`` pairs: everything but the module fields."""
    return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                 if f.name not in self.module_fields)

  def modules(self) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in self.module_fields)

  def identity(self) -> tuple:
    """A hashable identity for host caches (``k="auto"`` decisions, cost tables): the class, the options,
    and each module's ``id`` and config. Weights changed in place keep the identity: clear those caches
    (``specjax.runtime.RUNTIME.clear()``) after training a module."""
    return (type(self).__name__, self.options(), tuple((id(m), getattr(m, "cfg", None)) for m in self.modules()))

  def describe(self) -> dict[str, Any]:
    """A JSON-friendly description for reports."""
    return {"method": self.name, **{k: v for k, v in self.options()}}

  # --------------------------------------------------------------------------------- host side

  def check(self, target_cfg, needed_len: int) -> None:
    """Raises ValueError (naming the field) unless the proposer fits this target and a context of
    ``needed_len`` positions. The default accepts everything."""

  def split(self, split_model) -> tuple[Proposer, tuple, tuple]:
    """``(template, graphdefs, states)``: the proposer with its modules removed (captured by the jitted
    program), each module's graphdef, and each module's state (the program's traced arguments)."""
    pairs = [split_model(m) for m in self.modules()]
    template = dataclasses.replace(self, **{name: None for name in self.module_fields})
    return template, tuple(g for g, _ in pairs), tuple(s for _, s in pairs)

  def bind(self, graphdefs: tuple, states: tuple) -> Proposer:
    """Inside a trace: the template with its modules merged back from ``states``."""
    from flax import nnx

    merged = {name: nnx.merge(g, s) for name, g, s in zip(self.module_fields, graphdefs, states)}
    return dataclasses.replace(self, **merged)

  # --------------------------------------------------------------------------------- pure, jitted

  @abc.abstractmethod
  def init(self, target, prompts: jax.Array, prompt_lens: jax.Array, features: Features, max_len: int) -> Any:
    """The state after the target's prefill.

    Args:
      target: the target model (inside the trace).
      prompts: ``[B, P] int32`` right-padded prompts; prompt_lens: ``[B] int32 >= 1``.
      features: the target's :class:`Features` over the padded prompt ``[B, P, ...]``.
      max_len: static cache length the engine uses for the target (every position written is below it).

    The first round starts with ``last = prompts[b, prompt_lens[b] - 1]`` at position ``prompt_lens - 1``.
    """

  @abc.abstractmethod
  def propose(self, state, target, ctx: Context, keys: jax.Array, k: int, sampler: Sampler,
              steps: jax.Array | None) -> Proposal:
    """``k`` proposals per row (static k >= 1) from ``keys [B]``, drawn from distributions warped by
    ``sampler``: ``sampler.warp`` and ``sampler.draw`` for each position, ``sampler.push(d)`` after each draw
    (or ``sampler.draw_chain`` when the logits of all k positions come at once).

    ``steps`` (a dynamic schedule, ``[] int32`` in ``[1, k]``): proposals past it are masked by the
    engine, so a proposer may skip their work; None: all k are used.
    """

  def propose_tree(self, state, target, ctx: Context, keys: jax.Array, spec, sampler: Sampler) -> TreeProposal:
    """A tree of proposals per row (``spec``: a :class:`specjax.tree.TreeShape` or
    :class:`~specjax.tree.DynamicTree`), built with :func:`specjax.tree.grow` from the proposer's logits for
    each frontier node. ``commit`` then sees the accepted path as a chain (``Verified.window`` the root and
    the path's tokens, the features gathered along it). Proposers that cannot propose trees keep this
    default, which :meth:`check_tree` turns into a clear error on the host."""
    raise NotImplementedError(f"method {self.name!r} does not propose token trees")

  @property
  def proposes_trees(self) -> bool:
    """Whether :meth:`propose_tree` is implemented."""
    return type(self).propose_tree is not Proposer.propose_tree

  def check_tree(self, spec) -> None:
    """Raises ValueError (naming the field) unless the proposer can propose trees of ``spec``."""
    if not self.proposes_trees:
      raise ValueError(f"SpecConfig.tree: method {self.name!r} does not propose token trees; the methods that do "
                       f"are draft, eagle, mtp and medusa; use tree=None for a chain")
    if self.max_k is not None and spec.depth > self.max_k:
      raise ValueError(f"SpecConfig.tree: depth {spec.depth} exceeds what method {self.name!r} can propose "
                       f"({self.max_k} levels)")

  @abc.abstractmethod
  def commit(self, state, target, verified: Verified) -> Any:
    """The state for the next round, from the round's :class:`Verified` outcome; also called after a round
    without proposals (``window = [last]``, ``num_drafts = 0``, no ``propose`` before it)."""
