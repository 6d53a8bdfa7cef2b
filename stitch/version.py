"""The stitch release: one place, read by the package and by the caches that key on it."""
__version__ = "0.1.0"
