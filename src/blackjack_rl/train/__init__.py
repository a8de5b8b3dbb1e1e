"""`blackjack-rl train`: a small GRPO trainer for the torch policy (the `train` extra).

    cli.py      the subcommand's flags and handler (imports no torch, so --help always works)
    forward.py  llama-family forward in which many rows share one prompt prefix
    sampler.py  batched sampling with exact ids and logprobs
    policy.py   the torch model as a Policy (episodes and groups play it; requests batch up)
    model.py    load from a GGUF or a folder, LoRA, export safetensors + tokenizer
    grpo.py     group-relative advantages, clipped policy-gradient loss on trained tokens
    sources.py  where groups come from: played locally, or pulled from the trajectory API
    metrics.py  per-step numbers from the groups' own episode records
    loop.py     the training loop: steps, evaluations, checkpoints, JSONL log
    plot.py     the curves, as a PNG
"""

NEEDS_TORCH = "training and --policy hf need PyTorch: pip install 'blackjack-rl[train]' (the CPU build is enough)"
