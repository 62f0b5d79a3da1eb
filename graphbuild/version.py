"""graphbuild's version, below everything that records it (encodings' producer, the package)."""

__version__ = "0.1.0"
