"""Where jobs run: a Docker container or a host process, behind one small interface."""
from .base import Gone, Launch, Runtime  # noqa: F401
