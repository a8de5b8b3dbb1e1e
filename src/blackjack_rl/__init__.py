"""blackjack-rl: an RL environment where LLM agents learn Blackjack through tool calls."""

__version__ = "0.1.0"
