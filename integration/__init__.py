"""The framework layer over the optimizer: stitch as an XLA pass (``xla_pass``, with the
module rewrite in ``hlo_rewrite``), and end-to-end scenarios (``scripts/``, tests)."""
