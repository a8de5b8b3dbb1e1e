"""The game: Gymnasium's Blackjack-v1 table, seeded so a deal replays (table.py), and its exact
solution by dynamic programming (solver.py). Depends on nothing else of the package."""
