"""The package version, in a module of its own (imported by the root and by checkpoints)."""

__version__ = "0.1.0"
