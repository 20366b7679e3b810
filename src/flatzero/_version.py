"""flatzero's version, in a module of its own: checkpoints record it without importing the
package root (pyproject.toml reads it from here too)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
