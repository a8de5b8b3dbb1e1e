"""A torch model as a policy (`--policy hf`): the weights the trainer updates are the weights that play.

Needs the `train` extra (PyTorch, transformers); nothing here is imported until a torch
policy is asked for, so every other command works without it. The model code itself
(forward, logprobs, loading and saving, LoRA) is `blackjack_rl.model`, which the trainer
imports too.

    policy.py    the torch model as a Policy (episodes and groups play it; requests batch up),
                 and the trainer's side of it: `sample_with`, `recording`
    sampler.py   batched sampling with exact ids and logprobs, temperature / top-p / top-k / min-p
"""
