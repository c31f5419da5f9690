"""The package version (read by pyproject.toml and `simkv --version`)."""
__version__ = "0.1.0"
