"""`python -m blackjack_rl.policies.llama_server ARGS`: llama-cpp-python's OpenAI-compatible
server (`python -m llama_cpp.server ARGS`, the same arguments) with the weights in plain CPU
buffers, so it also runs on the machines where ggml's AMX kernels crash (see llama_load.py)."""

from __future__ import annotations

from blackjack_rl.policies.llama_load import plain_cpu_buffers


def main() -> None:
    from llama_cpp.server.__main__ import main as serve

    with plain_cpu_buffers():  # for the whole process: the server loads its models when it starts
        serve()


if __name__ == "__main__":
    main()
