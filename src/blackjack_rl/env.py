"""The environment as one small text-level object: `reset(seed)` -> prompt, `step(answer)` -> next turn.

This is the one game loop. Episode play, evaluation and every trainer adapter
(`blackjack_rl.adapters`) drive this object, so the rules, the parser, the scores, the turn
limit and the per-decision Q* record cannot drift apart between them. It knows text only:
no tokenizer and no policy, so a trainer that owns generation (TRL, verifiers, OpenEnv,
SkyRL) can use it as it is.

Rewards: every step before the last returns 0.0 and the final step returns the episode's
score (the chosen scoring mode, format bonus included), so a return summed over the steps
equals the score that `process` and `evaluate` record. Per-decision credit is in `info`
(Q* of both actions, the optimal action, the regret of the answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, NamedTuple, TypedDict

from blackjack_rl.game.table import Observation, Rules, Table
from blackjack_rl.contract.protocol import ACTION_NAMES, STICK, ParsedAction, observation_text, parse_action, system_prompt, tool_call_text
from blackjack_rl.contract.records import DecisionRecord, Outcome, Status, Truncation
from blackjack_rl.game.solver import Solution, solve

Scoring = Literal["outcome", "expected"]


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """What decides a game's score; nothing here knows about tokens."""

    invalid_score: float = -1.0
    max_turns: int = 10  # answers per episode, re-prompted ones included
    thinking: bool = False
    scoring: Scoring = "outcome"
    format_bonus: float = 0.0  # added in proportion to the share of well-formed answers
    # Re-prompt after an invalid answer, with the reason, up to this many times per episode
    # before it forfeits (as verifiers' game environments and TextArena do). 0: forfeit at once.
    invalid_retries: int = 0

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        if self.invalid_retries < 0:
            raise ValueError(f"invalid_retries must be 0 or more, got {self.invalid_retries}")


def decision(obs: Observation, natural: bool, action: int | None, optimal: int, regret: float | None,
             parse_error: str | None, text: str) -> DecisionRecord:
    """One answer, scored against Q* (an expectation, never the seeded deck): the record that
    samples.jsonl writes is the one the game keeps."""
    return DecisionRecord(
        state=[obs.player_sum, obs.dealer_card, int(obs.usable_ace)],
        natural=natural,
        action=ACTION_NAMES.get(action) if action is not None else None,
        optimal=ACTION_NAMES[optimal],
        regret=regret,
        parse_error=parse_error,
        text=text,
    )


@dataclass
class Play:
    """What one game produced: the record every consumer (episodes, evaluation, adapters) reads."""

    seed: int = 0
    status: Status = Status.PLAYING
    outcome: Outcome | None = None
    reward: float | None = None  # the game's reward, when the game finished
    score: float | None = None  # what training sees (the chosen scoring mode); None while playing or failed
    scores: dict[str, float] = field(default_factory=dict)  # every scoring mode, always reported
    start_value: float | None = None  # V*(first state): what optimal play expects from this deal
    invalid_reason: str | None = None
    retries: int = 0  # invalid answers that were re-prompted instead of ending the episode
    decisions: list[DecisionRecord] = field(default_factory=list)
    player_hand: list[int] = field(default_factory=list)
    dealer_hand: list[int] = field(default_factory=list)


def episode_scores(play: Play, settings: EnvSettings) -> dict[str, float]:
    """Both scoring modes for a played game.

    `outcome` is the game's reward, as the original. `expected` is what the decisions
    were worth: V*(s0) minus the regret of every decision, i.e. V*(s0) plus
    sum(Q*(s, a) - V*(s)). Both are expectations-consistent (for any policy their means
    over deals are equal), but `expected` does not pay for the luck of the cards, so its
    variance is far lower; it never looks at the seeded deck.
    """
    answers = len(play.decisions)
    bonus = settings.format_bonus * (sum(d.action is not None for d in play.decisions) / answers) if answers else 0.0
    if play.status != Status.FINISHED:
        return {"outcome": settings.invalid_score + bonus, "expected": settings.invalid_score + bonus}
    regret = sum(d.regret for d in play.decisions if d.regret is not None)
    return {"outcome": float(play.reward) + bonus, "expected": float(play.start_value) - regret + bonus}


def opening_messages(observation: Observation, thinking: bool = False) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system_prompt(thinking=thinking)},
        {"role": "user", "content": observation_text(*observation)},
    ]


def retry_text(parsed: ParsedAction, observation: Observation) -> str:
    """The feedback after an invalid answer when the episode re-prompts: why, what to write, the hand again."""
    return (
        f"That answer was not a valid call ({parsed.error.value}: {parsed.detail}). "
        f"Answer with exactly one take_action call, for example {tool_call_text(STICK)}\n"
        f"{observation_text(*observation)}"
    )


@lru_cache(maxsize=8)
def solution_for(rules: Rules) -> Solution:
    """The exact solution of a rule set, solved once per process (adapters build many envs)."""
    return solve(rules)


class StateInfo(TypedDict):
    player_sum: int
    dealer_card: int
    usable_ace: bool
    natural: bool


class ParseInfo(TypedDict):
    valid: bool
    action: str | None
    error: str | None
    detail: str | None


class StepInfo(TypedDict, total=False):
    """`info` of reset and step: a plain dict, as Gymnasium and the trainers' adapters pass it on,
    with these keys. The decision at hand: `state`, `q` (Q* of both actions), `optimal`; after
    an answer also `parse`, `regret` (valid answers), `status`, `outcome`, `turn`, `retries`,
    and once the episode is over `score`, `scores`, `invalid_reason`, `game_reward`."""

    seed: int
    start_value: float
    state: StateInfo
    q: dict[str, float]
    optimal: str
    parse: ParseInfo
    regret: float
    status: Status
    outcome: Outcome | None
    turn: int
    retries: int
    score: float | None
    scores: dict[str, float]
    invalid_reason: str | None
    game_reward: float | None


class StepResult(NamedTuple):
    """Gymnasium's five values, by name: the next user turn (None when the game is over), the
    reward, terminated, truncated, and the info."""

    observation: str | None
    reward: float
    terminated: bool
    truncated: bool
    info: StepInfo


class BlackjackEnv:
    """One game at a time over a reusable table; `reset(seed)` starts the next one.

    Not thread-safe: one instance per episode in flight (instances are cheap once the
    `Solution` is shared; pass the same one to all of them).
    """

    def __init__(
        self,
        solution: Solution | None = None,
        settings: EnvSettings = EnvSettings(),
        table: Table | None = None,
        rules: Rules | None = None,
    ) -> None:
        if solution is None:
            solution = solution_for(rules or (table.rules if table is not None else Rules()))
        self.solution = solution
        self.settings = settings
        self.table = table or Table(solution.rules)
        if self.table.rules != solution.rules:
            raise ValueError(f"the table plays {self.table.rules} but the solution is for {solution.rules}")
        self.play = Play()
        self.observation: Observation | None = None
        self._owns_table = table is None

    @property
    def rules(self) -> Rules:
        return self.solution.rules

    @property
    def natural(self) -> bool:
        return self.table.player_is_natural

    @property
    def done(self) -> bool:
        return self.play.status != Status.PLAYING

    @property
    def turn(self) -> int:
        """Answers given so far in this episode."""
        return len(self.play.decisions)

    def reset(self, seed: int, record: Play | None = None, start: Observation | None = None
              ) -> tuple[list[dict[str, str]], StepInfo]:
        """Deal `seed` (the same seed always deals the same cards and draws). `record`, when
        given, is filled in place of a fresh `Play` (episode play passes its `Episode`).
        `start` begins the game in that state instead of the dealt one (exploring starts)."""
        play = record if record is not None else Play()
        play.seed = int(seed)
        play.status = Status.PLAYING
        self.play = play
        self.observation = self.table.reset(play.seed, start)
        play.start_value = self.solution.v(self.observation, self.natural)
        info = {"seed": play.seed, "start_value": play.start_value, **self._state_info()}
        return opening_messages(self.observation, self.settings.thinking), info

    def step(self, answer_text: str | None, tool_calls: list | None = None, *, allow_retry: bool = True) -> StepResult:
        """Play one answer: `(observation text | None, reward, terminated, truncated, info)`.

        `observation` is the next user turn: the new hand, or the feedback of a re-prompt;
        None when the game is over. `truncated` means the turn limit ended the episode (the
        observation is then still returned, as Gymnasium does). `allow_retry=False` ends the
        episode on an invalid answer even when re-prompts remain (the caller's rollout is over).
        """
        if self.done or self.observation is None:
            raise RuntimeError("step() after the episode ended: call reset(seed) to deal a new hand")
        play, obs, natural = self.play, self.observation, self.natural
        parsed = parse_action(answer_text, tool_calls)
        info = self._state_info()
        best = self.solution.best_action(obs, natural)
        text = answer_text if isinstance(answer_text, str) else ""
        info["parse"] = {
            "valid": parsed.valid,
            "action": ACTION_NAMES.get(parsed.action) if parsed.action is not None else None,
            "error": parsed.error.value if parsed.error is not None else None,
            "detail": parsed.detail,
        }
        if not parsed.valid:
            play.decisions.append(decision(obs, natural, None, best, None, parsed.error.value, text))
            retry_left = play.retries < self.settings.invalid_retries and self.turn < self.settings.max_turns
            if allow_retry and retry_left:
                play.retries += 1
                return StepResult(retry_text(parsed, obs), 0.0, False, False, self._more(info))
            play.status, play.invalid_reason = Status.INVALID, parsed.error.value
            return StepResult(None, self._score(), True, False, self._more(info))

        regret = self.solution.regret(obs, parsed.action, natural)
        info["regret"] = regret
        play.decisions.append(decision(obs, natural, parsed.action, best, regret, None, text))
        result = self.table.step(parsed.action)
        if result.terminated:
            play.status, play.reward = Status.FINISHED, result.reward
            play.outcome = Outcome.WIN if result.reward > 0 else Outcome.LOSS if result.reward < 0 else Outcome.DRAW
            return StepResult(None, self._score(), True, False, self._more(info))
        self.observation = result.observation
        next_text = observation_text(*result.observation)
        if self.turn >= self.settings.max_turns:
            self.truncate(Truncation.TURN_LIMIT)
            return StepResult(next_text, float(play.score), False, True, self._more(info))
        return StepResult(next_text, 0.0, False, False, self._more(info))

    def truncate(self, reason: str) -> float:
        """End the episode without a game result (turn limit, or a caller's token budget); scored like invalid."""
        self.play.status, self.play.invalid_reason = Status.TRUNCATED, reason
        return self._score()

    def fail(self) -> None:
        """End the episode with no score: no answer could be obtained (never counted as a game)."""
        self.play.status, self.play.score = Status.FAILED, None
        self._record_hands()

    def close(self) -> None:
        if self._owns_table:
            self.table.close()

    # ------------------------------------------------------------------ internals

    def _score(self) -> float:
        play = self.play
        play.scores = episode_scores(play, self.settings)
        play.score = play.scores[self.settings.scoring]
        self._record_hands()
        return play.score

    def _record_hands(self) -> None:
        self.play.player_hand, self.play.dealer_hand = self.table.player_hand, self.table.dealer_hand

    def _state_info(self) -> StepInfo:
        """The decision at hand: the state, Q* of both actions and the optimal action."""
        obs, natural = self.observation, self.natural
        q_stick, q_hit = self.solution.q_values(obs, natural)
        return {
            "state": {"player_sum": obs.player_sum, "dealer_card": obs.dealer_card,
                      "usable_ace": obs.usable_ace, "natural": natural},
            "q": {"hit": q_hit, "stick": q_stick},
            "optimal": ACTION_NAMES[self.solution.best_action(obs, natural)],
        }

    def _more(self, info: StepInfo) -> StepInfo:
        """After an answer: how the episode stands."""
        play = self.play
        info.update(status=play.status, outcome=play.outcome, turn=self.turn, retries=play.retries)
        if play.status != Status.PLAYING:
            info.update(score=play.score, scores=dict(play.scores), invalid_reason=play.invalid_reason,
                        game_reward=play.reward)
        return info
