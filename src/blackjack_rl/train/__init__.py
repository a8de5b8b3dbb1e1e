"""`blackjack-rl train`: a small GRPO trainer for the torch policy (the `train` extra).

The model it trains is the torch policy (`policies/torch/`: forward, sampling, loading).

    cli.py      the subcommand's flags and handler (imports no torch, so --help always works)
    grpo.py     group-relative advantages, clipped policy-gradient loss on trained tokens
    sources.py  where groups come from: played locally, or pulled from the trajectory API
    metrics.py  per-step numbers from the groups' own episode records
    loop.py     the training loop: steps, evaluations, checkpoints, JSONL log
    plot.py     the curves, as a PNG
"""
