"""The one small interface every player implements: a conversation in, an answer out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # game.py imports Gymnasium, which the command line's help does not need
    from blackjack_rl.game.table import Observation


class InferenceError(RuntimeError):
    """The policy could not produce an answer (server down, timeout, HTTP error).

    An episode that hits this is marked failed: it is not a game result, so it is
    never scored as a loss or a draw (the Atropos original turned an HTTP 400 into a draw).
    """


@dataclass(frozen=True, slots=True)
class Turn:
    """Everything a policy may look at when it answers.

    LLM policies read `messages` or, when they can consume token ids exactly, `prompt_ids`;
    scripted bots read `observation`.
    """

    messages: Sequence[dict]
    prompt_ids: Sequence[int]
    observation: Observation
    natural: bool
    seed: int


@dataclass(slots=True)
class Reply:
    """An answer, and, when the policy knows them, the exact ids it sampled."""

    text: str
    tool_calls: list[Any] | None = None
    completion_ids: list[int] | None = None  # ends with the end-of-turn id when sampled
    logprobs: list[float] | None = None  # one per completion id
    finish_reason: str = "stop"  # "stop" or "length"
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    """A player. What some policies can do besides is declared by the protocols below, and
    callers ask `isinstance(policy, AnswersMany)`, never probe for a method by name."""

    name: str

    def generation_params(self) -> dict[str, Any]:
        """Recorded with every group, so a dataset says how it was sampled."""
        ...

    async def respond(self, turn: Turn) -> Reply: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class AnswersMany(Protocol):
    """n answers to one prompt in one request (one prefill): groups use it for a shared prompt."""

    async def respond_many(self, turn: Turn, n: int) -> list[Reply]: ...


@runtime_checkable
class ScoresAnswers(Protocol):
    """The model's logprob of every token of given answers, without sampling: counterfactual
    step groups and the exact strategy chart need it."""

    temperature: float  # the sampling temperature: the distribution its sampled logprobs are of

    async def answer_logprobs(self, prompt_ids: Sequence[int], answers: Sequence[Sequence[int]],
                              temperature: float | None = None) -> list[list[float]]: ...

    async def answer_logprobs_many(self, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                                   temperature: float | None = None,
                                   same_kernels: bool = True) -> list[list[list[float]]]: ...


@runtime_checkable
class KnowsItsPolicy(Protocol):
    """A scripted bot, whose probability of hitting in a state is known exactly."""

    def hit_probability(self, observation: Observation, natural: bool) -> float: ...


async def answers_at_once(policy: Policy, turn: Turn, n: int) -> list[Reply] | None:
    """n answers to one prompt in one request (`respond_many`, one prefill on a server that
    honours `n`), or None when the policy cannot, answers short, or fails: the caller then asks
    one by one, and each of those requests reports its own failure."""
    if not isinstance(policy, AnswersMany) or n < 2:
        return None
    try:
        replies = list(await policy.respond_many(turn, n))
    except InferenceError:
        return None
    return replies if len(replies) == n else None
