"""Compression methods, one module per family."""
