"""Measurement: evaluation metrics with confidence intervals, the exact strategy chart and its
probe, and runs compared deal by deal."""
