"""Training of targets and draft models (installed as ``specjax.train``)."""
