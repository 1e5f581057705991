"""The suite's shared parts: a simulated node with the daemons started on it (node.py). Test
modules import from here; fixtures built on these are in tests/conftest.py."""
