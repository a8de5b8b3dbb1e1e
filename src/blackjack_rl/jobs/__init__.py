"""The jobs: a deal runner, a sink and a report (process, evaluate, grid, compare, serve)."""
