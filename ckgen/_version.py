"""The package version (pyproject.toml says the same; tests/test_layout.py checks)."""
__version__ = "0.1.0"
