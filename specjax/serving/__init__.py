"""Serving: requests of any length and settings decoded together in a fixed number of slots.

- :mod:`specjax.serving.slots`: the slot engine (prefill, insert, one jitted speculative step for every slot).
- :mod:`specjax.serving.policy`: which k (or token tree) each step runs, from measured step costs and the online
  acceptance.
- :mod:`specjax.serving.text`: stable text out of a token stream (UTF-8 and BPE boundaries), stop strings.
- :mod:`specjax.serving.scheduler`: the engine thread that owns the device, a bounded queue of requests.
- :mod:`specjax.serving.stream`: ``specjax.stream``, one prompt's output yielded as rounds are accepted.
- :mod:`specjax.serving.api`: the OpenAI protocol (request validation, response and chunk objects).
- :mod:`specjax.serving.metrics`: the Prometheus metrics of ``/metrics``.
- :mod:`specjax.serving.server`: ``specjax serve``, the Starlette app on uvicorn over the scheduler.
"""
