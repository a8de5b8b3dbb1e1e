"""What the model sees and says, and what is written: the prompt, tool schema and parser
(protocol.py), token ids with masks and logprobs (tokens.py), the records of files and wire
(records.py)."""
