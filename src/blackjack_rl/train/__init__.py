"""`blackjack-rl train`: a small GRPO trainer for the torch policy (the `train` extra).

The model it trains is the torch policy's (`policies/torch/`), through the model code both
share (`blackjack_rl.model`: forward, logprobs, loading and saving, LoRA).

    cli.py          the subcommand's flags and handler (imports no torch, so --help always works)
    trainer.py      the Trainer (setup, resume, step, evaluate, export) and run_training, its driver
    grpo.py         group-relative advantages, clipped policy-gradient loss on trained tokens, one step
    groups.py       the typed group (contract.records.ScoredDataGroup) as both sources give it
    sources.py      where groups come from: played locally, or pulled from the trajectory API
    metrics.py      per-step numbers from the groups' own episode records; evaluations, the chart
    checkpoints.py  --save-every checkpoints and --resume
    log.py          train_log.jsonl and the line printed per row
    plot.py         the curves, as a PNG
    portable.py     paths in command.txt and settings.json, never absolute
"""
