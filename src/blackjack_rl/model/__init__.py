"""The torch model: what the torch policy samples with and the trainer trains (the `train` extra).

Both `policies/torch/` (the model as a Policy) and `train/` (GRPO on it) import it; it imports
neither. Nothing here is imported until a torch model is asked for, and this file imports no
torch, so every other command works without it.

    forward.py     llama-family forward in which many rows share one prompt prefix
    logprobs.py    the model's logprob of given tokens (scoring, and the trainer's loss)
    io.py          load from a GGUF or a folder, LoRA, export safetensors + tokenizer
    lora_stack.py  a fresh LoRA adapter trained over a saved one, saved as one adapter
    base_ref.py    which base model a saved adapter belongs to, by name and content hash
"""

NEEDS_TORCH = "training and --policy hf need PyTorch: pip install 'blackjack-rl[train]' (the CPU build is enough)"
