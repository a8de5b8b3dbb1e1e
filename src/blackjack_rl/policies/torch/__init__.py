"""A torch model as a policy (`--policy hf`): the weights the trainer updates are the weights that play.

Needs the `train` extra (PyTorch, transformers); nothing here is imported until a torch
policy is asked for, so every other command works without it.

    forward.py   llama-family forward in which many rows share one prompt prefix
    logprobs.py  the model's logprob of given tokens (scoring, and the trainer's loss)
    sampler.py   batched sampling with exact ids and logprobs, temperature / top-p / top-k / min-p
    policy.py    the torch model as a Policy (episodes and groups play it; requests batch up)
    model.py     load from a GGUF or a folder, LoRA, export safetensors + tokenizer
"""

NEEDS_TORCH = "training and --policy hf need PyTorch: pip install 'blackjack-rl[train]' (the CPU build is enough)"
