"""spanvisor: a reliability sidecar for AI agents (the runtime package)."""

__version__ = "0.2.0"
