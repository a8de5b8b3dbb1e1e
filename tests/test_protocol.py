"""The model contract: prompt text, tool schema and the answer parser.

The parser sits on the path of every model answer during training and evaluation, so besides
a table of answers real models and servers produce, it is fuzzed for the one property the rest
of the system relies on: it always returns a ParsedAction and never raises.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blackjack_rl.contract.protocol import (
    ACTION_NAMES,
    HIT,
    STICK,
    TOOL_NAME,
    TOOLS,
    ParsedAction,
    ParseError,
    observation_text,
    parse_action,
    split_thinking,
    system_prompt,
    tool_call_text,
)

CALL_HIT = '{"name": "take_action", "arguments": {"action": "hit"}}'
CALL_STICK = '{"name": "take_action", "arguments": {"action": "stick"}}'

# (id, answer text, expected action or expected error)
TEXT_CASES = [
    # --- the canonical Hermes form and whitespace/case variants
    ("canonical-hit", f"<tool_call>\n{CALL_HIT}\n</tool_call>", HIT),
    ("canonical-stick", f"<tool_call>\n{CALL_STICK}\n</tool_call>", STICK),
    ("no-newlines", f"<tool_call>{CALL_HIT}</tool_call>", HIT),
    ("lots-of-whitespace", f"\n\n  <tool_call>  \n\t {CALL_STICK} \n\n </tool_call>  \n", STICK),
    ("tag-case", f"<TOOL_CALL>{CALL_HIT}</Tool_Call>", HIT),
    ("spaced-tags", f"< tool_call >{CALL_HIT}< / tool_call >", HIT),
    ("seed-key-order", '<tool_call>\n{"arguments": {"action": "stick"}, "name": "take_action"}\n</tool_call>', STICK),
    ("missing-close-tag", f"<tool_call>\n{CALL_HIT}", HIT),
    ("prose-before-after", f"I have 12 against a 10, so I hit.\n<tool_call>\n{CALL_HIT}\n</tool_call>\nGood luck!", HIT),
    ("compact-json", '<tool_call>{"name":"take_action","arguments":{"action":"stick"}}</tool_call>', STICK),
    ("extra-argument", '<tool_call>{"name": "take_action", "arguments": {"action": "hit", "why": "low"}}</tool_call>', HIT),
    ("braces-in-strings", '<tool_call>{"name": "take_action", "arguments": {"action": "hit", "note": "} {"}}</tool_call>', HIT),
    # --- code fences
    ("fence-inside-tags", f"<tool_call>\n```json\n{CALL_STICK}\n```\n</tool_call>", STICK),
    ("fence-instead-of-tags", f"Here is my move:\n```json\n{CALL_HIT}\n```", HIT),
    ("plain-fence", f"```\n{CALL_STICK}\n```", STICK),
    # --- bare JSON
    ("bare-json", CALL_HIT, HIT),
    ("bare-json-in-prose", f"My call: {CALL_STICK} (sticking on 19)", STICK),
    ("bare-list", f"[{CALL_HIT}]", HIT),
    ("stray-brace-before-call", f"Hand {{14, soft}} so {CALL_HIT}", HIT),
    # --- Python-dict style and JSON/Python mixtures
    ("single-quotes", "<tool_call>{'name': 'take_action', 'arguments': {'action': 'hit'}}</tool_call>", HIT),
    ("single-quotes-bare", "{'name': 'take_action', 'arguments': {'action': 'stick'}}", STICK),
    ("python-literals", "<tool_call>{'name': 'take_action', 'arguments': {'action': 'hit', 'sure': True, 'x': None}}</tool_call>", HIT),
    ("json-literals-in-python", "<tool_call>{'name': 'take_action', 'arguments': {'action': 'hit', 'sure': true, 'x': null}}</tool_call>", HIT),
    ("trailing-comma", '<tool_call>{"name": "take_action", "arguments": {"action": "stick",},}</tool_call>', STICK),
    # --- arguments shapes and wrappers
    ("arguments-as-string", '<tool_call>{"name": "take_action", "arguments": "{\\"action\\": \\"hit\\"}"}</tool_call>', HIT),
    ("arguments-double-encoded", '<tool_call>{"name": "take_action", "arguments": "\\"{\\\\\\"action\\\\\\": \\\\\\"stick\\\\\\"}\\""}</tool_call>', STICK),
    ("parameters-synonym", '<tool_call>{"name": "take_action", "parameters": {"action": "stick"}}</tool_call>', STICK),
    ("function-wrapper", '<tool_call>{"function": {"name": "take_action", "arguments": {"action": "hit"}}}</tool_call>', HIT),
    ("type-function-wrapper", '<tool_call>{"type": "function", "function": {"name": "take_action", "arguments": "{\\"action\\": \\"stick\\"}"}}</tool_call>', STICK),
    ("type-function-flat", '<tool_call>{"type": "function", "name": "take_action", "parameters": {"action": "hit"}}</tool_call>', HIT),
    ("bare-function-wrapper", '{"type": "function", "function": {"name": "take_action", "arguments": {"action": "hit"}}}', HIT),
    # --- value normalisation
    ("name-case-space", '<tool_call>{"name": " Take_Action ", "arguments": {"action": "hit"}}</tool_call>', HIT),
    ("action-case-space", '<tool_call>{"name": "take_action", "arguments": {"action": "  STICK\\n"}}</tool_call>', STICK),
    # --- thinking
    ("after-thinking", f"<think>\n14 vs 10: hit.\n</think>\n<tool_call>\n{CALL_HIT}\n</tool_call>", HIT),
    ("call-drafted-in-thinking", f"<think>maybe <tool_call>{CALL_HIT}</tool_call>? no.</think>\n<tool_call>{CALL_STICK}</tool_call>", STICK),
    ("orphan-think-close", f"the dealer shows 6, stick.\n</think>\n\n<tool_call>{CALL_STICK}</tool_call>", STICK),
    ("second-think-block-ignored", f"<tool_call>{CALL_HIT}</tool_call><think>{CALL_STICK}</think>", HIT),
    ("first-of-two-calls", f"<tool_call>{CALL_STICK}</tool_call>\n<tool_call>{CALL_HIT}</tool_call>", STICK),
    ("prose-mention-of-tags", f"I answer in <tool_call> tags. State {{\"sum\": 14}}.\n<tool_call>{CALL_HIT}</tool_call>", HIT),
    # --- NO_CALL: nothing that looks like a call
    ("empty", "", ParseError.NO_CALL),
    ("whitespace", "  \n\t ", ParseError.NO_CALL),
    ("bare-word-hit", "hit", ParseError.NO_CALL),
    ("bare-sentence", "I will stick.", ParseError.NO_CALL),
    ("action-object-without-name", '{"action": "hit"}', ParseError.NO_CALL),
    ("only-thinking", "<think>I should hit.</think>", ParseError.NO_CALL),
    ("unclosed-thinking-hides-call", f"<think>hmm <tool_call>{CALL_HIT}</tool_call>", ParseError.NO_CALL),
    ("unrelated-json", 'Your state: {"sum": 14, "dealer": 10}', ParseError.NO_CALL),
    # --- BAD_JSON: a call-looking region that is not an object
    ("empty-tags", "<tool_call></tool_call>", ParseError.BAD_JSON),
    ("word-in-tags", "<tool_call>hit</tool_call>", ParseError.BAD_JSON),
    ("truncated-object", '<tool_call>{"name": "take_action", "arguments": {"action": "hit"}</tool_call>', ParseError.BAD_JSON),
    ("garbage-object", "<tool_call>{name = take_action; action = hit}</tool_call>", ParseError.BAD_JSON),
    ("function-call-syntax", '<tool_call>take_action(action="hit")</tool_call>', ParseError.BAD_JSON),
    ("truncated-wrapper", '<tool_call>{"type": "function", "function": {"name": "take_action", "arguments": {"action": "hit"}}</tool_call>', ParseError.BAD_JSON),
    ("stray-open-brace-before-call", f"I think {{maybe hit. {CALL_HIT}", HIT),
    ("stray-open-brace-in-tags", f"<tool_call>{{ {CALL_STICK}</tool_call>", STICK),
    ("apostrophe-in-braces-before-call", f"{{you're close}} so {CALL_STICK}", STICK),
    ("bare-truncated-call", '{"name": "take_action", "arguments": {"action": "hit"}', ParseError.BAD_JSON),
    ("fenced-broken-call", '```json\n{"name": "take_action" "arguments": {"action": "hit"}}\n```', ParseError.BAD_JSON),
    ("arguments-string-not-json", '<tool_call>{"name": "take_action", "arguments": "{action: hit"}</tool_call>', ParseError.BAD_JSON),
    # --- WRONG_TOOL
    ("other-tool", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', ParseError.WRONG_TOOL),
    ("action-name-as-tool", '<tool_call>{"name": "hit", "arguments": {}}</tool_call>', ParseError.WRONG_TOOL),
    ("no-name-in-tags", '<tool_call>{"arguments": {"action": "hit"}}</tool_call>', ParseError.WRONG_TOOL),
    ("name-not-string", '<tool_call>{"name": 7, "arguments": {"action": "hit"}}</tool_call>', ParseError.WRONG_TOOL),
    ("bare-other-tool", '{"name": "search", "arguments": {"q": "blackjack"}}', ParseError.WRONG_TOOL),
    # --- BAD_ACTION
    ("synonym-stand", '<tool_call>{"name": "take_action", "arguments": {"action": "stand"}}</tool_call>', ParseError.BAD_ACTION),
    ("action-missing", '<tool_call>{"name": "take_action", "arguments": {}}</tool_call>', ParseError.BAD_ACTION),
    ("arguments-missing", '<tool_call>{"name": "take_action"}</tool_call>', ParseError.BAD_ACTION),
    ("flattened-action", '<tool_call>{"name": "take_action", "action": "hit"}</tool_call>', ParseError.BAD_ACTION),
    ("action-number", '<tool_call>{"name": "take_action", "arguments": {"action": 1}}</tool_call>', ParseError.BAD_ACTION),
    ("action-null", '<tool_call>{"name": "take_action", "arguments": {"action": null}}</tool_call>', ParseError.BAD_ACTION),
    ("arguments-list", '<tool_call>{"name": "take_action", "arguments": ["hit"]}</tool_call>', ParseError.BAD_ACTION),
    ("arguments-empty-string", '<tool_call>{"name": "take_action", "arguments": ""}</tool_call>', ParseError.BAD_ACTION),
    ("both-actions", '<tool_call>{"name": "take_action", "arguments": {"action": "hit or stick"}}</tool_call>', ParseError.BAD_ACTION),
]


def _check_invariants(result: object) -> None:
    assert isinstance(result, ParsedAction)
    assert (result.action is None) == (result.error is not None)
    assert result.action in (None, HIT, STICK)
    assert result.error is None or isinstance(result.error, ParseError)
    assert isinstance(result.detail, str)
    assert result.valid == (result.error is None)
    assert (result.detail == "") == result.valid
    # The catch-all in parse_action is a last line of defence; no input should need it.
    assert not result.detail.startswith("unparseable response"), result.detail


@pytest.mark.parametrize(
    ("text", "expected"), [case[1:] for case in TEXT_CASES], ids=[case[0] for case in TEXT_CASES]
)
def test_text_variants(text: str, expected: int | ParseError) -> None:
    result = parse_action(text)
    _check_invariants(result)
    if isinstance(expected, ParseError):
        assert result.error is expected, result
        assert result.detail
    else:
        assert result.action == expected, result
        assert result.valid


def test_case_ids_are_unique() -> None:
    ids = [case[0] for case in TEXT_CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("action", [HIT, STICK])
def test_round_trip(action: int) -> None:
    assert parse_action(tool_call_text(action)) == ParsedAction(action, None, "")


@pytest.mark.parametrize("action", [HIT, STICK])
def test_round_trip_after_thinking(action: int) -> None:
    text = f"<think>\nweighing it up\n</think>\n{tool_call_text(action)}"
    assert parse_action(text).action == action


def test_tool_call_text_is_canonical() -> None:
    assert tool_call_text(HIT) == (
        '<tool_call>\n{"name": "take_action", "arguments": {"action": "hit"}}\n</tool_call>'
    )


@pytest.mark.parametrize("bad", [2, -1, None, "hit"])
def test_tool_call_text_rejects_non_actions(bad: object) -> None:
    with pytest.raises(ValueError):
        tool_call_text(bad)  # type: ignore[arg-type]


def test_none_and_non_text() -> None:
    assert parse_action(None).error is ParseError.NO_CALL
    assert parse_action(12345).error is ParseError.NO_CALL  # type: ignore[arg-type]
    assert parse_action(object()).error is ParseError.NO_CALL  # type: ignore[arg-type]


def test_bytes_are_decoded() -> None:
    assert parse_action(tool_call_text(HIT).encode()).action == HIT  # type: ignore[arg-type]
    result = parse_action(b"\xff\xfe\x00<tool_call>\x80")  # type: ignore[arg-type]
    _check_invariants(result)
    assert result.error is ParseError.BAD_JSON


def test_lone_surrogates() -> None:
    assert parse_action("\ud800" + tool_call_text(STICK) + "\udfff").action == STICK
    text = '<tool_call>{"name": "take_action", "arguments": {"action": "\ud800"}}</tool_call>'
    assert parse_action(text).error is ParseError.BAD_ACTION


def test_error_values_serialise_as_strings() -> None:
    assert json.dumps(ParseError.BAD_JSON) == '"bad_json"'
    assert {e.value for e in ParseError} == {"no_call", "bad_json", "wrong_tool", "bad_action"}


def test_parsed_action_is_frozen() -> None:
    result = parse_action(tool_call_text(HIT))
    with pytest.raises(AttributeError):
        result.action = STICK  # type: ignore[misc]


# --------------------------------------------------------------------------- native tool_calls


def _openai_dict(name: str, arguments: object, call_id: str = "call_0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _sdk_object(name: object, arguments: object) -> SimpleNamespace:
    return SimpleNamespace(
        id="call_0", type="function", function=SimpleNamespace(name=name, arguments=arguments)
    )


NATIVE_CASES = [
    ("dict-args-string", [_openai_dict("take_action", '{"action": "hit"}')], HIT),
    ("dict-args-dict", [_openai_dict("take_action", {"action": "stick"})], STICK),
    ("dict-args-python-style", [_openai_dict("take_action", "{'action': 'hit'}")], HIT),
    ("dict-name-case", [_openai_dict("TAKE_ACTION", '{"action": " Stick "}')], STICK),
    ("flat-dict", [{"name": "take_action", "arguments": {"action": "hit"}}], HIT),
    ("flat-parameters", [{"name": "take_action", "parameters": {"action": "stick"}}], STICK),
    ("tuple-of-calls", (_openai_dict("take_action", '{"action": "hit"}'),), HIT),
    ("sdk-object", [_sdk_object("take_action", '{"action": "hit"}')], HIT),
    ("sdk-object-dict-args", [_sdk_object("take_action", {"action": "stick"})], STICK),
    ("sdk-object-function-dict", [SimpleNamespace(function={"name": "take_action", "arguments": '{"action": "hit"}'})], HIT),
    (
        "first-of-several",
        [_openai_dict("take_action", '{"action": "stick"}'), _openai_dict("take_action", '{"action": "hit"}')],
        STICK,
    ),
    ("wrong-tool", [_openai_dict("get_weather", '{"city": "Oslo"}')], ParseError.WRONG_TOOL),
    ("sdk-wrong-tool", [_sdk_object("lookup", "{}")], ParseError.WRONG_TOOL),
    ("name-missing", [{"type": "function", "function": {"arguments": '{"action": "hit"}'}}], ParseError.WRONG_TOOL),
    ("sdk-name-not-string", [_sdk_object(3, '{"action": "hit"}')], ParseError.WRONG_TOOL),
    ("args-not-json", [_openai_dict("take_action", '{"action": "hit"')], ParseError.BAD_JSON),
    ("args-empty", [_openai_dict("take_action", "")], ParseError.BAD_ACTION),
    ("args-empty-object", [_openai_dict("take_action", "{}")], ParseError.BAD_ACTION),
    ("args-synonym", [_openai_dict("take_action", '{"action": "stand"}')], ParseError.BAD_ACTION),
    ("args-not-object", [_openai_dict("take_action", '["hit"]')], ParseError.BAD_ACTION),
    ("garbage-element", [42], ParseError.BAD_JSON),
    ("none-element", [None], ParseError.BAD_JSON),
    ("empty-dict-element", [{}], ParseError.BAD_JSON),
]


@pytest.mark.parametrize(
    ("tool_calls", "expected"), [c[1:] for c in NATIVE_CASES], ids=[c[0] for c in NATIVE_CASES]
)
def test_native_tool_calls(tool_calls: list, expected: int | ParseError) -> None:
    # The text holds a different valid call: whatever the native call says must decide.
    result = parse_action(tool_call_text(STICK if expected == HIT else HIT), tool_calls)
    _check_invariants(result)
    if isinstance(expected, ParseError):
        assert result.error is expected, result
    else:
        assert result.action == expected, result


@pytest.mark.parametrize("tool_calls", [None, [], ()])
def test_empty_tool_calls_fall_back_to_text(tool_calls: object) -> None:
    assert parse_action(tool_call_text(STICK), tool_calls).action == STICK  # type: ignore[arg-type]


def test_sdk_object_with_raising_attributes() -> None:
    class Hostile:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError(name)

    result = parse_action("", [Hostile()])
    _check_invariants(result)
    assert result.error is ParseError.BAD_JSON


# --------------------------------------------------------------------------- thinking


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>a</think>b", ("a", "b")),
        ("  <THINK>\n a \n</Think>\n b \n", ("a", "b")),
        ("no thinking here", ("", "no thinking here")),
        ("<think>never closed <tool_call>", ("never closed <tool_call>", "")),
        ("prompt-opened thought</think>answer", ("prompt-opened thought", "answer")),
        ("answer <think>late</think> more", ("", "answer <think>late</think> more")),
        ("", ("", "")),
        ("<think></think>", ("", "")),
    ],
)
def test_split_thinking(text: str, expected: tuple[str, str]) -> None:
    assert split_thinking(text) == expected


# --------------------------------------------------------------------------- prompt side


def _tools_block(prompt: str) -> str:
    match = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.DOTALL)
    assert match is not None
    return match.group(1)


@pytest.mark.parametrize("thinking", [False, True])
def test_system_prompt_embeds_tools_as_json(thinking: bool) -> None:
    prompt = system_prompt(thinking)
    assert prompt.startswith("You are an AI agent playing Blackjack")
    assert json.loads(_tools_block(prompt)) == TOOLS
    assert "<tool_call>" in prompt and "</tool_call>" in prompt
    assert tool_call_text(STICK) in prompt
    assert prompt == system_prompt(thinking)


def test_system_prompt_thinking_modes_differ() -> None:
    plain, thinking = system_prompt(), system_prompt(thinking=True)
    assert "<think>" in thinking and "</think>" in thinking
    assert "no reasoning" in plain and "<think>\n" not in plain
    assert plain != thinking


def test_system_prompt_examples_parse() -> None:
    """Every call shown to the model as an example must be one the parser accepts."""
    for prompt in (system_prompt(False), system_prompt(True)):
        examples = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", prompt)
        assert examples
        for example in examples:
            assert parse_action(f"<tool_call>{example}</tool_call>").valid


def test_tools_schema() -> None:
    assert len(TOOLS) == 1
    function = TOOLS[0]["function"]
    assert TOOLS[0]["type"] == "function"
    assert function["name"] == TOOL_NAME == "take_action"
    parameters = function["parameters"]
    assert parameters["required"] == ["action"]
    assert parameters["properties"]["action"]["enum"] == ["hit", "stick"]
    assert sorted(parameters["properties"]["action"]["enum"]) == sorted(ACTION_NAMES.values())
    json.dumps(TOOLS)  # serialisable as sent to servers


def test_action_constants_match_gymnasium() -> None:
    assert (HIT, STICK) == (1, 0)
    assert ACTION_NAMES == {1: "hit", 0: "stick"}


@pytest.mark.parametrize(
    ("obs", "expected"),
    [
        ((14, 10, False), "Your current hand sum is 14. The dealer is showing a 10. You have a usable ace: no."),
        ((17, 1, True), "Your current hand sum is 17. The dealer is showing a 1. You have a usable ace: yes."),
        ((4, 8, 0), "Your current hand sum is 4. The dealer is showing a 8. You have a usable ace: no."),
        ((21, 2, 1), "Your current hand sum is 21. The dealer is showing a 2. You have a usable ace: yes."),
    ],
)
def test_observation_text(obs: tuple, expected: str) -> None:
    assert observation_text(*obs) == expected


def test_observation_text_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    text = observation_text(np.int64(13), np.int64(7), np.bool_(True))
    assert text == "Your current hand sum is 13. The dealer is showing a 7. You have a usable ace: yes."


# --------------------------------------------------------------------------- adversarial input


ADVERSARIAL = {
    "open-braces": "{" * 200_000,
    "open-tags": "<tool_call>" * 200_000,
    "tag-then-braces": "<tool_call>" + "{" * 200_000,
    "open-brackets": '{"name": ' + "[" * 200_000,
    "balanced-deep": "<tool_call>" + "{" * 5_000 + "}" * 5_000,
    "deep-list": '<tool_call>{"name": ' + "[" * 3_000 + "]" * 3_000 + "}",
    "think-tags": "<think>" * 200_000,
    "close-think-tags": "</think>" * 200_000,
    "quote-braces": "{'" * 200_000,
    "many-objects": '{"name": "x"}' * 100_000,
    "key-pattern": '"name":' * 200_000,
    "long-whitespace-tag": "<" + " " * 1_000_000 + "tool_call>",
    "escapes": "<tool_call>{" + '\\"' * 100_000,
    "huge-digits": '<tool_call>{"name": "take_action", "arguments": {"action": ' + "9" * 15_000 + "}}",
    "unary-chain": "<tool_call>{'name': " + "-" * 15_000 + "1}",
}


@pytest.mark.timeout(120)  # a super-linear blow-up on these inputs runs for hours: it fails here, not on speed
@pytest.mark.parametrize("text", list(ADVERSARIAL.values()), ids=list(ADVERSARIAL))
def test_adversarial_input_is_safe(text: str) -> None:
    result = parse_action(text)
    _check_invariants(result)
    assert result.error is not None


def test_call_after_long_thinking_is_found() -> None:
    text = "<think>" + "ponder " * 10_000 + "</think>" + tool_call_text(HIT)
    assert parse_action(text).action == HIT


# --------------------------------------------------------------------------- fuzzing

# No per-example deadline: it is a clock, and a busy machine fails it. Blow-ups are caught by
# the adversarial inputs above, under a timeout far beyond any honest run.
FUZZ = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=400)

fragments = st.sampled_from(
    [
        "<tool_call>", "</tool_call>", "<TOOL_CALL>", "<think>", "</think>", "```json", "```",
        "{", "}", "[", "]", '"', "'", "\\", ":", ",", " ", "\n",
        '"name"', "'name'", '"function"', '"arguments"', '"parameters"', '"action"',
        '"take_action"', '"hit"', '"stick"', "true", "null", "None", "hit", "stick",
    ]
)
structured_text = st.lists(st.one_of(fragments, any_text.map(lambda s: s[:8])), max_size=60).map("".join)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=20,
)
names = st.sampled_from(["take_action", "TAKE_ACTION ", "hit", ""]) | any_text | json_values
action_values = st.sampled_from(["hit", "stick", " Hit", "stand", ""]) | json_values
arguments = st.fixed_dictionaries({"action": action_values}) | json_values
call_dicts = st.fixed_dictionaries(
    {"name": names},
    optional={"arguments": arguments | arguments.map(json.dumps), "parameters": arguments},
)
wrapped_calls = call_dicts | call_dicts.map(lambda c: {"type": "function", "function": c})

native_elements = st.one_of(
    json_values,
    wrapped_calls,
    st.builds(
        lambda n, a: SimpleNamespace(function=SimpleNamespace(name=n, arguments=a)),
        names,
        arguments | arguments.map(json.dumps) | any_text,
    ),
    st.builds(SimpleNamespace),
)


@FUZZ
@given(any_text)
def test_fuzz_arbitrary_text(text: str) -> None:
    _check_invariants(parse_action(text))


@FUZZ
@given(structured_text)
def test_fuzz_structured_text(text: str) -> None:
    _check_invariants(parse_action(text))
    thought, rest = split_thinking(text)
    assert isinstance(thought, str) and isinstance(rest, str)


@FUZZ
@given(any_text, st.sampled_from(["<tool_call>", "<tool_call>\n```json\n", "```json\n"]))
def test_fuzz_text_in_tags(text: str, opening: str) -> None:
    _check_invariants(parse_action(f"{opening}{text}</tool_call>"))


@FUZZ
@given(json_values | wrapped_calls, st.booleans())
def test_fuzz_json_in_tags(value: object, single_quotes: bool) -> None:
    body = repr(value) if single_quotes else json.dumps(value)
    _check_invariants(parse_action(f"<tool_call>\n{body}\n</tool_call>"))


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_bytes(data: bytes) -> None:
    _check_invariants(parse_action(data))  # type: ignore[arg-type]


@FUZZ
@given(st.lists(native_elements, max_size=3) | json_values, structured_text)
def test_fuzz_tool_calls(tool_calls: object, text: str) -> None:
    _check_invariants(parse_action(text, tool_calls))  # type: ignore[arg-type]


prose = st.text(
    alphabet=st.characters(exclude_categories=(), exclude_characters="<>{}[]\"'\\`"), max_size=80
)


@FUZZ
@given(
    prose,
    prose,
    st.sampled_from([HIT, STICK]),
    st.sampled_from(["take_action", "Take_Action", " take_action "]),
    st.booleans(),
    st.booleans(),
)
def test_fuzz_valid_calls_in_prose_are_found(
    before: str, after: str, action: int, name: str, upper: bool, as_string: bool
) -> None:
    """Oracle property: any well-formed call, whatever prose surrounds it, yields its action."""
    word = ACTION_NAMES[action].upper() if upper else ACTION_NAMES[action]
    args = {"action": word}
    call = {"name": name, "arguments": json.dumps(args) if as_string else args}
    assert parse_action(f"{before}<tool_call>{json.dumps(call)}</tool_call>{after}").action == action
