"""colo: share one node's GPUs safely: budgets, MPS or time-slicing, a durable queue."""
__version__ = "0.1.0"
