"""dckpt's version, in one place: the package exports it, every manifest records it, the
CLI prints it. A base module (imports nothing), so any layer may read it."""

__all__ = ["__version__"]

__version__ = "0.1.0"
