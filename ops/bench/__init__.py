"""``pagedq bench``: pagedq against its peers (transformers static and continuous batching, vLLM, and
pagedq itself behind Redis), side by side in one run on identical work. See ``runner`` for the flow,
``workloads`` for what is run, ``registry`` for the systems (each driven by its own module, all to the
contract of ``system``), ``report`` for the metrics.

The CLI wires it as ``pagedq bench`` through :func:`add_arguments` and :func:`run`; ``python -m ops.bench``
does the same.
"""

from ops.bench.runner import add_arguments, run

__all__ = ["add_arguments", "run"]
