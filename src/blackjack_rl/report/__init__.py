"""What a person reads: console tables and self-contained HTML pages.

evaluation.py writes an evaluate run's report.html (strategy.py, episodes.py, plots.py
compute and draw its parts); comparison.py the page of `compare`; dataset.py the
incremental viewer of a `process` dataset; console.py the tables printed by the CLI.
"""
