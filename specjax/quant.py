"""Weight-only quantization: 8-bit and 4-bit weights, activations and everything after them in float.

``quantize(model, "int8")`` (or ``"int4"``) returns a copy of a specjax model or head set whose matrix
weights are :class:`QuantizedArray` values: integer codes plus float scales (and, for 4 bits, per-group
minima). Norm scales, biases and integer variables stay as they were. Activations, logits, warping and
acceptance keep the model's float dtype (``cfg.dtype``): only the bytes a forward pass streams shrink.

Layouts (``axis``: the weight's contracting axis, along which groups run):

- ``int8``: symmetric, ``w = q * scale``, ``q`` in [-127, 127] (int8), one scale per output channel
  (``group=None``) or per ``group`` consecutive entries along ``axis`` (GGUF's Q8_0 is ``group=32``).
- ``int4``: asymmetric, ``w = q * scale + low``, ``q`` in [0, 15], two codes packed per uint8 byte along
  ``axis``, one ``(scale, low)`` pair per ``group`` entries (default 32: GGUF's Q4_1 block).

The model code is unchanged: it reads a weight as ``self.w[...].astype(dt)``, and for a
:class:`QuantizedArray` that ``astype`` *is* the dequantization (unpack, multiply, add), written as
elementwise operations on the codes so that XLA can fuse them into the consumer of the weight. Row lookups
(token embeddings) go through :func:`take_rows`, which gathers codes and scales and dequantizes only the rows
it reads.

Qwix (google/qwix 0.1.8) was tried first and does not serve these modules: its PTQ provider intercepts only
one method of an NNX model (``__call__``), while heads call ``forward_features``, ``unembed`` and
``embed_tokens`` directly, and its quantized weight box (``WithAux`` around a ``QArray``) fails on the
``w[...].astype(dt)`` every specjax module uses (``ValueError: Unsupported type: QArray`` from
``flax_util.update_boxed``) and on the ``jnp.take`` of the tied embedding. See docs/guide.md, "Quantized weights".
"""

from __future__ import annotations

import dataclasses
import re
import jax
import jax.numpy as jnp
import numpy as np

from specjax.numerics import FLOAT_DTYPES

BITS = {"int8": 8, "int4": 4}
QUANT_DTYPES = tuple(BITS)
DEFAULT_GROUP = {"int8": None, "int4": 32}
# Float parameters that stay float: biases (added, not multiplied) and position tables (gathered by position).
_KEEP_FLOAT = re.compile(r"^(b|b_.*|bq|bk|bv|bo|pos_embed)$")
# The contracting axis of weights not stored [in, out]: embedding tables (rows gathered, the tied head contracts
# the last axis), attention outputs [H, Dh, D] (contract heads and head_dim: groups run along head_dim), Medusa's
# stacked heads [j, D, V] and residual blocks [j, L, D, D].
_AXIS_BY_NAME = {"embed": -1, "wo": 1, "lm_heads": 1}


def is_weight(name: str, ndim: int) -> bool:
  """Whether a float parameter called ``name`` with ``ndim`` axes is a matrix weight that quantization replaces
  (two or more axes; not a bias or a position table)."""
  return ndim >= 2 and not _KEEP_FLOAT.match(name)


def weight_axis(name: str, ndim: int) -> int:
  """The contracting axis (non-negative) of a weight called ``name`` with ``ndim`` axes, in specjax's layout: the
  axis along which its quantization groups run."""
  return _AXIS_BY_NAME.get(name, ndim - 2 if ndim == 4 else 0) % ndim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A weight held as integer codes and float scales; reads as the float array it stands for.

  ``q``: int8 codes of ``shape`` (8 bits) or uint8 bytes holding two 4-bit codes each along ``axis`` (4 bits:
  ``shape[axis] // 2`` there). ``scale`` (and ``low`` for 4 bits, else None): float (float16 for 4 bits), of
  ``shape`` with ``shape[axis]`` replaced by the number of groups. ``dtype`` is the float dtype
  :meth:`dequantize` returns by default (the activation dtype).
  """

  q: jax.Array
  scale: jax.Array
  low: jax.Array | None
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  group: int = dataclasses.field(metadata=dict(static=True))
  bits: int = dataclasses.field(metadata=dict(static=True))
  float_dtype: str = dataclasses.field(metadata=dict(static=True))

  @property
  def dtype(self):
    return jnp.dtype(self.float_dtype)

  def with_float_dtype(self, dtype) -> QuantizedArray:
    """The same codes read as ``dtype`` (8-bit scales stored in it; float16 scales, those of 4 bits and of GGUF's
    Q8_0 blocks, stay float16)."""
    scale = self.scale if self.scale.dtype == jnp.float16 else self.scale.astype(dtype)
    return dataclasses.replace(self, scale=scale, float_dtype=jnp.dtype(dtype).name)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in (self.q, self.scale, self.low) if a is not None)

  def codes(self) -> jax.Array:
    """The integer codes as int32-free ``int8``/``uint8`` of ``shape`` (4-bit codes unpacked)."""
    if self.bits == 8:
      return self.q
    lo, hi = self.q & 0xF, self.q >> 4  # codes 2i and 2i + 1 along axis
    both = jnp.stack([lo, hi], axis=self.axis + 1)
    return both.reshape(self.shape)

  def dequantize(self, dtype=None) -> jax.Array:
    """The float weight ``[*shape]`` in ``dtype`` (default: the scales' dtype). Elementwise on the codes, so
    XLA fuses it into whatever reads the weight."""
    dtype = jnp.dtype(self.dtype if dtype is None else dtype)
    ax, n_groups = self.axis, self.shape[self.axis] // self.group
    split = self.shape[:ax] + (n_groups, self.group) + self.shape[ax + 1:]
    codes = self.codes().astype(dtype).reshape(split)
    w = codes * jnp.expand_dims(self.scale.astype(dtype), ax + 1)
    if self.low is not None:
      w = w + jnp.expand_dims(self.low.astype(dtype), ax + 1)
    return w.reshape(self.shape)

  # The array protocol the model code uses: ``w[...]`` and ``w[...].astype(dt)`` read the weight.
  def astype(self, dtype) -> jax.Array:
    return self.dequantize(dtype)

  def __getitem__(self, key):
    if key is Ellipsis:
      return self
    if isinstance(key, slice) and self.axis != 0:  # a slice of leading entries (Medusa's stacked heads)
      low = None if self.low is None else self.low[key]
      return dataclasses.replace(self, q=self.q[key], scale=self.scale[key], low=low,
                                 shape=(len(range(*key.indices(self.shape[0]))),) + self.shape[1:])
    return self.dequantize()[key]

  @property
  def T(self) -> jax.Array:  # noqa: N802 (the array protocol's name)
    return self.dequantize().T

  def take_rows(self, rows: jax.Array) -> jax.Array:
    """``dequantize()[rows]`` for a table quantized along its last axis, reading only those rows (through an
    optimization barrier, as :func:`take_rows`)."""
    q, scale, low, rows = jax.lax.optimization_barrier((self.q, self.scale, self.low, rows))
    low = None if low is None else jnp.take(low, rows, axis=0)
    part = dataclasses.replace(self, q=jnp.take(q, rows, axis=0), scale=jnp.take(scale, rows, axis=0), low=low,
                               shape=tuple(rows.shape) + self.shape[1:], axis=self.axis + rows.ndim - 1)
    return part.dequantize()


def take_rows(table, rows: jax.Array) -> jax.Array:
  """``jnp.take(table, rows, axis=0)`` for a float table or a :class:`QuantizedArray` (only the read rows are
  dequantized).

  The table and the rows pass an optimization barrier first. Without it XLA:CPU, which gathers bfloat16 in
  float32, converts the whole table to float32 and hoists that conversion out of a decode loop, to run once per
  program run: for SmolLM2-135M in mixed precision a 49,152 x 576 table converted in ~21 ms at every call of the
  server's step program (8 % of a width-1 call of 8 rounds) and once per ``generate``. Behind the barrier the
  conversion stays fused with the gather and touches only the rows read (0.2 ms for 8 lookups)."""
  if isinstance(table, QuantizedArray):
    return table.take_rows(rows)
  table, rows = jax.lax.optimization_barrier((table, rows))
  return jnp.take(table, rows, axis=0)


def check_group(name: str, group, size: int, bits: int) -> int:
  """The group size along an axis of ``size``, or ValueError naming ``name``: an integer that divides ``size``
  (even, for 4 bits); None means the whole axis (per channel)."""
  if group is None:
    group = size
  ok = isinstance(group, (int, np.integer)) and not isinstance(group, bool) and group >= 1 and size % group == 0
  if not ok or (bits == 4 and group % 2):
    raise ValueError(f"{name} must be {'an even' if bits == 4 else 'an'} integer >= 1 dividing the quantized axis "
                     f"({size}) or None (per channel), got {group!r}")
  return int(group)


def quantize_array(w, bits: int, axis: int = 0, group: int | None = None, float_dtype=None) -> QuantizedArray:
  """``w`` (float, host or device) as a :class:`QuantizedArray` with ``bits`` (8: symmetric absmax per group;
  4: asymmetric min/max per group, GGUF Q4_1's rule) along ``axis``, read as ``float_dtype`` (default: ``w``'s).

  Raises ValueError naming ``bits`` or ``group`` when they are not allowed."""
  if bits not in (4, 8):
    raise ValueError(f"bits must be one of (4, 8), got {bits!r}")
  float_dtype = jnp.dtype(w.dtype if float_dtype is None else float_dtype)
  x = np.asarray(jax.device_get(w), np.float32)
  axis = axis % x.ndim
  group = check_group("group", group, x.shape[axis], bits)
  split = x.shape[:axis] + (x.shape[axis] // group, group) + x.shape[axis + 1:]
  g = x.reshape(split)
  if bits == 8:
    scale = np.abs(g).max(axis=axis + 1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(g / np.expand_dims(safe, axis + 1)), -127, 127).astype(np.int8).reshape(x.shape)
    return from_codes(q, jnp.asarray(scale, float_dtype), None, axis, group, float_dtype)
  # Scales and minima in float16 (as GGUF's Q4_1 blocks): 5 bits a weight in all; codes from the rounded pair.
  low = g.min(axis=axis + 1).astype(np.float16).astype(np.float32)
  scale = ((g.max(axis=axis + 1) - low) / 15.0).astype(np.float16).astype(np.float32)
  safe = np.where(scale > 0, scale, 1.0)
  codes = np.clip(np.rint((g - np.expand_dims(low, axis + 1)) / np.expand_dims(safe, axis + 1)), 0, 15)
  return from_codes(codes.astype(np.uint8).reshape(x.shape), scale.astype(np.float16), low.astype(np.float16),
                    axis, group, float_dtype)


def from_codes(codes: np.ndarray, scale: np.ndarray, low: np.ndarray | None, axis: int, group: int,
               float_dtype) -> QuantizedArray:
  """A :class:`QuantizedArray` from unpacked codes and their groups' scales, taken as they are (no rounding).

  Args:
    codes: ``[*shape]``: int8 (8 bits, ``w = q * scale``) or uint8 in [0, 15] (4 bits, ``w = q * scale + low``,
      packed here two a byte along ``axis``).
    scale, low: ``shape`` with ``shape[axis]`` replaced by ``shape[axis] // group``; ``low`` None for 8 bits.
      Stored in their own dtype (float16 for 4 bits).
    axis: the contracting axis, along which each run of ``group`` codes shares one scale.
    float_dtype: the dtype the array reads as.
  """
  codes = np.asarray(codes)
  axis = axis % codes.ndim
  bits = 8 if codes.dtype == np.int8 else 4
  if bits == 4:
    pairs = codes.reshape(codes.shape[:axis] + (codes.shape[axis] // 2, 2) + codes.shape[axis + 1:])
    q = np.take(pairs, 0, axis=axis + 1) | (np.take(pairs, 1, axis=axis + 1) << 4)
  else:
    q = codes
  return QuantizedArray(q=jnp.asarray(q), scale=jnp.asarray(scale), low=None if low is None else jnp.asarray(low),
                        shape=tuple(codes.shape), axis=axis, group=int(group), bits=bits,
                        float_dtype=jnp.dtype(float_dtype).name)


def check_quant_dtype(name: str, value: str, allowed: tuple[str, ...]) -> str:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
  return value


def check_group_option(name: str, group, dtype: str) -> int | None:
  """A group option for ``dtype`` (``"int8"``/``"int4"``) resolved: an integer >= 1 (even for int4), None (per
  channel), or ``"default"`` (``DEFAULT_GROUP[dtype]``); otherwise ValueError naming ``name`` and the allowed
  values."""
  if isinstance(group, str) and group == "default":
    return DEFAULT_GROUP[dtype]
  bits = BITS[dtype]
  if group is not None and not (isinstance(group, (int, np.integer)) and not isinstance(group, bool)
                                and group >= 1 and (bits == 8 or group % 2 == 0)):
    raise ValueError(f"{name} must be {'an even' if bits == 4 else 'an'} integer >= 1 for {dtype}, None (per "
                     f"channel) or 'default', got {group!r}")
  return None if group is None else int(group)


def quantize(model, dtype: str, group: int | None | str = "default", activation_dtype: str | None = None):
  """A copy of ``model`` (a specjax model or head set) with its matrix weights quantized; the input is unchanged.

  Args:
    dtype: ``"int8"`` (per-channel scales by default) or ``"int4"`` (groups of 32 by default).
    group: entries per scale along each weight's contracting axis; None: one scale per output channel;
      ``"default"``: ``DEFAULT_GROUP[dtype]``. A weight whose axis the group does not divide stays float.
    activation_dtype: the float dtype of activations and scales (one of ``FLOAT_DTYPES``); default: the
      model's ``cfg.dtype``.

  Which weights: every floating parameter with two or more axes except biases and position tables (norm scales
  have one axis). Integer variables (a head's vocabulary map) are kept.

  Raises:
    ValueError: naming ``dtype``, ``group`` or ``activation_dtype`` and the allowed values.
  """
  from flax import nnx

  from specjax.loading import cast

  check_quant_dtype("dtype", dtype, QUANT_DTYPES)
  bits = BITS[dtype]
  group = check_group_option("group", group, dtype)
  act = model.cfg.dtype if activation_dtype is None else activation_dtype
  check_quant_dtype("activation_dtype", act, FLOAT_DTYPES)
  model = cast(model, act)
  graphdef, state = nnx.split(model)

  def convert(path, variable):
    value = variable.get_value() if hasattr(variable, "get_value") else variable.value
    name = str(path[-1])
    if (not isinstance(variable, nnx.Param) or isinstance(value, QuantizedArray)
        or not jnp.issubdtype(value.dtype, jnp.floating) or not is_weight(name, value.ndim)):
      return variable
    axis = weight_axis(name, value.ndim)
    size = value.shape[axis]
    g = size if group is None else group
    if size % g or (bits == 4 and g % 2):
      return variable  # the group does not fit this axis: stays float
    return variable.replace(quantize_array(value, bits, axis, g, act))

  state = nnx.map_state(convert, state) if hasattr(nnx, "map_state") else _map_state(convert, state)
  return nnx.merge(graphdef, state)


def _map_state(fn, state):
  from flax import nnx

  flat = nnx.to_flat_state(state)
  return nnx.from_flat_state([(path, fn(path, v)) for path, v in flat])


def is_quantized(model) -> bool:
  """Whether any weight of ``model`` is a :class:`QuantizedArray`."""
  from flax import nnx

  return any(isinstance(v, QuantizedArray) for v in jax.tree.leaves(
      nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedArray)))


def weight_bytes(model) -> int:
  """Bytes of ``model``'s parameters as stored (codes, scales and float parameters)."""
  from flax import nnx

  leaves = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedArray))
  return sum(x.nbytes if isinstance(x, QuantizedArray) else int(x.size) * x.dtype.itemsize for x in leaves)

