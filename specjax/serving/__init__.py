"""Serving: requests of any length and settings decoded together in a fixed number of slots.

- :mod:`specjax.serving.slots`: the slot engine (prefill, insert, one jitted speculative step for every slot).
- :mod:`specjax.serving.policy`: which k each step runs, from measured step costs and the online acceptance.
"""
