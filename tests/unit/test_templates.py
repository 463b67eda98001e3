"""Tests for rayjobs.data.templates: literal segment tables per template, RowError cases, prefix
stability."""

from __future__ import annotations

import pytest

from rayjobs.data import templates
from rayjobs.data.templates import RowError, Segment

NO_INPUT_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n"
)
WITH_INPUT_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\nAdd."
    "\n\n### Input:\n2 and 3\n\n### Response:\n"
)

# template name, row, column_map, expected segments (prompt untrained, answer trained).
ALPACA_AND_TEXT = {
    "alpaca_without_input": (
        "alpaca",
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        {},
        [Segment(NO_INPUT_PROMPT, False), Segment("Hi!", True)],
    ),
    "alpaca_input_column_absent": (
        "alpaca",
        {"instruction": "Say hi.", "output": "Hi!"},
        {},
        [Segment(NO_INPUT_PROMPT, False), Segment("Hi!", True)],
    ),
    "alpaca_whitespace_input_counts_as_none": (
        "alpaca",
        {"instruction": "Say hi.", "input": "  \n", "output": "Hi!"},
        {},
        [Segment(NO_INPUT_PROMPT, False), Segment("Hi!", True)],
    ),
    "alpaca_with_input": (
        "alpaca",
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {},
        [Segment(WITH_INPUT_PROMPT, False), Segment("5", True)],
    ),
    "alpaca_column_map_output_to_response": (
        "alpaca",
        {"instruction": "Say hi.", "response": "Hi!", "output": "ignored"},
        {"output": "response"},
        [Segment(NO_INPUT_PROMPT, False), Segment("Hi!", True)],
    ),
    "text": ("text", {"text": "Hello world!"}, {}, [Segment("Hello world!", True)]),
    "text_column_map": (
        "text",
        {"content": "Hello"},
        {"text": "content"},
        [Segment("Hello", True)],
    ),
}


@pytest.mark.parametrize(
    "name, row, column_map, expected", list(ALPACA_AND_TEXT.values()), ids=list(ALPACA_AND_TEXT)
)
def test_alpaca_and_text_segments(name, row, column_map, expected):
    assert getattr(templates, name)(row, column_map) == expected


# Rows rendered with the ChatML layout: each assistant turn's text plus its "<|im_end|>\n" is
# trainable; system/user/tool turns and every "<|im_start|>assistant\n" generation prompt are not.
CHAT = {
    "openai_multi_turn_with_system": (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"},
            ]
        },
        [
            Segment(
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            Segment("Hello<|im_end|>\n", True),
            Segment("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
            Segment("Ciao<|im_end|>\n", True),
        ],
    ),
    "openai_trailing_user_turn_untrained": (
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
            ]
        },
        [
            Segment("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
            Segment("Hello<|im_end|>\n", True),
            Segment("<|im_start|>user\nBye<|im_end|>\n", False),
        ],
    ),
    "sharegpt_tool_call_with_system_column": (
        {
            "system": "Use tools.",
            "conversations": [
                {"from": "human", "value": "Weather?"},
                {"from": "function_call", "value": '{"name": "w"}'},
                {"from": "observation", "value": '{"t": 20}'},
                {"from": "gpt", "value": "It is 20."},
            ],
        },
        [
            Segment(
                "<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            # function_call is an assistant turn whose call is trained in the <tool_call> layout;
            # observation is a tool turn (not trained).
            Segment('<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call><|im_end|>\n', True),
            Segment('<|im_start|>tool\n{"t": 20}<|im_end|>\n<|im_start|>assistant\n', False),
            Segment("It is 20.<|im_end|>\n", True),
        ],
    ),
    # The glaive / LLaMA-Factory layout: ``tools`` as JSON text, bare schemas, calls as JSON text.
    "sharegpt_tools_json_text_go_in_the_system_turn": (
        {
            "tools": '[{"name": "w", "parameters": {"type": "object"}}]',
            "conversations": [
                {"from": "human", "value": "Weather?"},
                {"from": "function_call", "value": '{"name": "w", "arguments": {"city": "Oslo"}}'},
                {"from": "observation", "value": "5C"},
                {"from": "gpt", "value": "5C."},
            ],
        },
        [
            Segment(
                "<|im_start|>system\n# Tools\n\nYou may call these functions. For each call, "
                'write a JSON object with the function\'s "name" and "arguments" within <tool_call>'
                '</tool_call> tags.\n<tools>\n{"type": "function", "function": {"name": "w", '
                '"parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
                "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            Segment(
                '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
                "<|im_end|>\n",
                True,
            ),
            Segment("<|im_start|>tool\n5C<|im_end|>\n<|im_start|>assistant\n", False),
            Segment("5C.<|im_end|>\n", True),
        ],
    ),
    # Reasoning under any of transformers' names is trained with the answer, in <think> tags.
    "openai_reasoning_trains_in_think_tags": (
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "reasoning": "Add them.\n", "content": "4"},
            ]
        },
        [
            Segment("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
            Segment("<think>\nAdd them.\n</think>\n\n4<|im_end|>\n", True),
        ],
    ),
    # OpenAI: content null beside tool_calls, arguments as a JSON string, two parallel calls.
    "openai_parallel_tool_calls_with_string_arguments": (
        {
            "system": "S",
            "tools": [{"type": "function", "function": {"name": "w"}}],
            "messages": [
                {"role": "user", "content": "Oslo, Rome?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                        },
                        {
                            "id": "b",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"city": "Rome"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "a", "content": "5C"},
                {"role": "tool", "tool_call_id": "b", "content": "20C"},
                {"role": "assistant", "content": "Cold, warm."},
            ],
        },
        [
            Segment(
                "<|im_start|>system\nS\n\n# Tools\n\nYou may call these functions. For each call,"
                ' write a JSON object with the function\'s "name" and "arguments" within '
                '<tool_call></tool_call> tags.\n<tools>\n{"type": "function", "function": '
                '{"name": "w"}}\n</tools><|im_end|>\n'
                "<|im_start|>user\nOslo, Rome?<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            Segment(
                '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "w", "arguments": {"city": "Rome"}}\n</tool_call>'
                "<|im_end|>\n",
                True,
            ),
            Segment(
                "<|im_start|>tool\n5C<|im_end|>\n<|im_start|>tool\n20C<|im_end|>\n"
                "<|im_start|>assistant\n",
                False,
            ),
            Segment("Cold, warm.<|im_end|>\n", True),
        ],
    ),
}


@pytest.mark.parametrize("row, expected", list(CHAT.values()), ids=list(CHAT))
def test_chat_segments_with_chatml(row, expected):
    segments = templates.chat(row, {}, templates.chatml)
    assert segments == expected
    # The segments partition the full rendering: nothing lost, nothing repeated.
    assert "".join(s.text for s in segments) == templates.chatml(
        templates.read_conversation(row, {})[0], False, templates.chat_tools(row, {})
    )


def test_sharegpt_roles_normalise_to_openai_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "H"},
            {"from": "gpt", "value": "G"},
            {"from": "function_call", "value": '[{"name": "f"}, {"name": "g", "arguments": "{}"}]'},
            {"from": "observation", "value": "O"},
            {"from": "user", "value": "U"},
            {"from": "assistant", "value": "A"},
            {"from": "tool", "value": "T"},
        ]
    }
    assert templates.read_conversation(row, {})[0] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "H"},
        {"role": "assistant", "content": "G"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {}}},
                {"type": "function", "function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "O"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "T"},
    ]


def _chat_with_chatml(row, column_map):
    return templates.chat(row, column_map, templates.chatml)


USER = {"role": "user", "content": "Hi"}


def _call_turn(function: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"function": function}]}


# template function, row, column_map, expected RowError.field, text the message must contain.
ROW_ERRORS = {
    "alpaca_missing_output": (
        templates.alpaca,
        {"instruction": "Say hi."},
        {},
        "output",
        "['instruction']",
    ),
    "alpaca_missing_mapped_column_names_field_and_column": (
        templates.alpaca,
        {"instruction": "Say hi.", "output": "Hi!"},
        {"output": "response"},
        "output (column 'response')",
        "missing",
    ),
    "chat_missing_mapped_column_names_field_and_column": (
        templates.read_conversation,
        {"messages": [USER]},
        {"messages": "dialog"},
        "messages (column 'dialog')",
        "missing (nor 'conversations'); the row has columns ['messages']",
    ),
    "alpaca_instruction_not_text": (
        templates.alpaca,
        {"instruction": 3, "output": "Hi!"},
        {},
        "instruction",
        "got int",
    ),
    "alpaca_input_not_text": (
        templates.alpaca,
        {"instruction": "Add.", "input": ["2", "3"], "output": "5"},
        {},
        "input",
        "got list",
    ),
    "text_missing": (templates.text, {"body": "x"}, {}, "text", "['body']"),
    "text_not_text": (templates.text, {"text": {"a": 1}}, {}, "text", "got dict"),
    "chat_no_messages_nor_conversations": (
        _chat_with_chatml,
        {"dialog": []},
        {},
        "messages",
        "conversations",
    ),
    "chat_empty_messages": (_chat_with_chatml, {"messages": []}, {}, "messages", "non-empty"),
    "chat_without_assistant_turn": (
        _chat_with_chatml,
        {"messages": [USER]},
        {},
        "messages",
        "no assistant turn",
    ),
    "chat_unknown_openai_role": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "robot", "content": "beep"}]},
        {},
        "messages[1]",
        "robot",
    ),
    "chat_unknown_sharegpt_role": (
        _chat_with_chatml,
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "beep"}]},
        {},
        "conversations[1]",
        "bot",
    ),
    "alpaca_null_output_is_null_not_missing": (
        templates.alpaca,
        {"instruction": "Say hi.", "output": None},
        {},
        "output",
        "'output': null",
    ),
    "chat_system_not_text": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "Hello"}], "system": 5},
        {},
        "system",
        "expected text, got int",
    ),
    "chat_tool_call_arguments_not_json": (
        _chat_with_chatml,
        {"messages": [USER, _call_turn({"name": "w", "arguments": "{city: Oslo}"})]},
        {},
        "messages[1].tool_calls[0]",
        "arguments is not valid JSON",
    ),
    "chat_tool_call_arguments_not_an_object": (
        _chat_with_chatml,
        {"messages": [USER, _call_turn({"name": "w", "arguments": '["Oslo"]'})]},
        {},
        "messages[1].tool_calls[0]",
        "arguments are not a JSON object but list",
    ),
    "chat_tool_call_without_a_name": (
        _chat_with_chatml,
        {"messages": [USER, _call_turn({"arguments": {}})]},
        {},
        "messages[1].tool_calls[0]",
        "expected a call with a function name",
    ),
    "chat_legacy_function_call_without_a_name": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "x", "function_call": {"n": 1}}]},
        {},
        "messages[1].tool_calls[0]",
        "expected a call with a function name",
    ),
    "chat_sharegpt_function_call_not_json": (
        _chat_with_chatml,
        {
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "function_call", "value": "w()"},
            ]
        },
        {},
        "conversations[1]",
        "the call is not valid JSON",
    ),
    "chat_reasoning_not_text": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "4", "thinking": ["a", "b"]}]},
        {},
        "messages[1]",
        "the turn's reasoning is not text but list",
    ),
    "chat_tools_not_a_list": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "Hi"}], "tools": '{"name": "w"}'},
        {},
        "tools",
        "expected a list of tool schemas, got dict",
    ),
    "chat_tools_json_text_invalid": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "Hi"}], "functions": "[{name: w}]"},
        {"tools": "functions"},
        "tools (column 'functions')",
        "the tools list is not valid JSON",
    ),
    "chat_tool_schema_without_a_name": (
        _chat_with_chatml,
        {
            "messages": [USER, {"role": "assistant", "content": "Hi"}],
            "tools": [{"type": "function"}],
        },
        {},
        "tools[0]",
        "expected a schema with a name",
    ),
    "chat_content_not_text": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": None}]},
        {},
        "messages[1]",
        "known role and text content",
    ),
}


@pytest.mark.parametrize(
    "template, row, column_map, field, hint", list(ROW_ERRORS.values()), ids=list(ROW_ERRORS)
)
def test_bad_rows_raise_row_error_naming_the_field(template, row, column_map, field, hint):
    with pytest.raises(RowError) as caught:
        template(row, column_map)
    assert caught.value.field == field
    assert f"field {field!r}" in str(caught.value)
    assert hint in str(caught.value)


def _hides_earlier_assistant_turns(messages, add_generation_prompt):
    """A render that is not prefix-stable: only the last message may show assistant content
    (like templates that strip earlier reasoning), so a longer conversation rewrites older text."""
    rendered = ""
    for index, message in enumerate(messages):
        last = index == len(messages) - 1
        content = message["content"] if message["role"] != "assistant" or last else ""
        rendered += f"<{message['role']}>{content}</{message['role']}>"
    return rendered + ("<assistant>" if add_generation_prompt else "")


def test_non_prefix_stable_render_raises_row_error():
    row = {
        "messages": [
            USER,
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Ciao"},
        ]
    }
    with pytest.raises(RowError, match="not prefix-stable"):
        templates.chat(row, {}, _hides_earlier_assistant_turns)


def test_non_prefix_stable_render_with_trailing_user_turn_raises_row_error():
    row = {
        "messages": [
            USER,
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ]
    }
    with pytest.raises(RowError, match="not prefix-stable"):
        templates.chat(row, {}, _hides_earlier_assistant_turns)


# The preference template (task: dpo): row → (prompt, chosen, rejected) texts, ChatML rendering.
CHATML_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
PREFERENCE = {
    "text_prompt": (
        {"prompt": "\n\nHuman: Hi\n\nAssistant:", "chosen": " Hello!", "rejected": " Go away."},
        {},
        templates.Preference("\n\nHuman: Hi\n\nAssistant:", " Hello!", " Go away."),
    ),
    "messages_prompt_text_replies": (
        {"prompt": [USER], "chosen": "Hello!", "rejected": "Go away."},
        {},
        templates.Preference(CHATML_PROMPT, "Hello!<|im_end|>\n", "Go away.<|im_end|>\n"),
    ),
    "messages_prompt_with_system_and_message_replies": (
        {
            "system": "Be kind.",
            "prompt": [USER],
            "chosen": {"role": "assistant", "content": "Hello!"},
            "rejected": [{"role": "assistant", "content": "Go away."}],
        },
        {},
        templates.Preference(
            "<|im_start|>system\nBe kind.<|im_end|>\n" + CHATML_PROMPT,
            "Hello!<|im_end|>\n",
            "Go away.<|im_end|>\n",
        ),
    ),
    "llamafactory_conversations": (
        {
            "conversations": [{"from": "human", "value": "Hi"}],
            "chosen": {"from": "gpt", "value": "Hello!"},
            "rejected": {"from": "gpt", "value": "Go away."},
        },
        {},
        templates.Preference(CHATML_PROMPT, "Hello!<|im_end|>\n", "Go away.<|im_end|>\n"),
    ),
    "tools_and_a_tool_call_in_the_prompt": (
        {
            "tools": '[{"name": "w"}]',
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "function_call", "value": '{"name": "w"}'},
                {"from": "observation", "value": "5C"},
            ],
            "chosen": "Cold.",
            "rejected": "Warm.",
        },
        {},
        templates.Preference(
            "<|im_start|>system\n# Tools\n\nYou may call these functions. For each call, write a "
            'JSON object with the function\'s "name" and "arguments" within <tool_call></tool_call>'
            ' tags.\n<tools>\n{"type": "function", "function": {"name": "w"}}\n</tools><|im_end|>\n'
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
            '{"name": "w", "arguments": {}}\n</tool_call><|im_end|>\n'
            "<|im_start|>tool\n5C<|im_end|>\n<|im_start|>assistant\n",
            "Cold.<|im_end|>\n",
            "Warm.<|im_end|>\n",
        ),
    ),
    "mapped_columns": (
        {"question": "2+2?", "good": "4", "bad": "5"},
        {"prompt": "question", "chosen": "good", "rejected": "bad"},
        templates.Preference("2+2?", "4", "5"),
    ),
}


@pytest.mark.parametrize(("row", "column_map", "expected"), PREFERENCE.values(), ids=PREFERENCE)
def test_preference_texts(row, column_map, expected):
    assert templates.preference(row, column_map) == expected


PREFERENCE_ERRORS = {
    "missing_rejected": ({"prompt": "p", "chosen": "c"}, "rejected", "missing_field"),
    "empty_chosen": ({"prompt": "p", "chosen": " ", "rejected": "r"}, "chosen", "empty_field"),
    "empty_prompt": ({"prompt": "", "chosen": "c", "rejected": "r"}, "prompt", "empty_field"),
    "user_reply": (
        {"prompt": "p", "chosen": {"role": "user", "content": "c"}, "rejected": "r"},
        "chosen",
        "wrong_type",
    ),
    "two_replies": (
        {"prompt": "p", "chosen": ["a", "b"], "rejected": "r"},
        "chosen",
        "wrong_type",
    ),
    # the turn at fault, in the column the turns came from (a system column's turn not counted)
    "prompt_ends_with_the_answer": (
        {"prompt": [USER, {"role": "assistant", "content": "x"}], "chosen": "c", "rejected": "r"},
        "prompt[1]",
        "wrong_type",
    ),
    "prompt_with_system_ends_with_the_answer": (
        {
            "system": "s",
            "prompt": [USER, {"role": "assistant", "content": "x"}],
            "chosen": "c",
            "rejected": "r",
        },
        "prompt[1]",
        "wrong_type",
    ),  # fmt: skip
    "conversation_ends_with_the_answer": (
        {
            "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "x"}],
            "chosen": "c",
            "rejected": "r",
        },
        "conversations[1]",
        "wrong_type",
    ),  # fmt: skip
    "bad_prompt_turn": (
        {"prompt": [USER, {"role": "alien", "content": "x"}], "chosen": "c", "rejected": "r"},
        "prompt[1]",
        "wrong_type",
    ),
}


@pytest.mark.parametrize(
    ("row", "field", "reason"), PREFERENCE_ERRORS.values(), ids=PREFERENCE_ERRORS
)
def test_bad_preference_rows_name_the_field_and_reason(row, field, reason):
    with pytest.raises(RowError) as caught:
        templates.preference(row, {})
    assert (caught.value.field, caught.value.reason) == (field, reason)


def test_bad_turns_are_named_by_the_datasets_own_column():
    """With ``column_map``, a turn at fault is named by the column the data holds it in."""
    row = {"dialog": [USER, {"role": "alien", "content": "x"}], "good": "c", "bad": "r"}
    mapped = {"prompt": "dialog", "chosen": "good", "rejected": "bad"}
    with pytest.raises(RowError) as caught:
        templates.preference(row, mapped)
    assert caught.value.field == "dialog[1]"
    with pytest.raises(RowError) as caught:
        templates.chat({"dialog": row["dialog"]}, {"messages": "dialog"})
    assert caught.value.field == "dialog[1]"


# prompt_completion (TRL's standard SFT type): text rows, and conversational rows rendered with
# ChatML; the prompt untrained, the completion trained.
PROMPT_COMPLETION = {
    "text": (
        {"prompt": "The sky is", "completion": " blue."},
        {},
        [Segment("The sky is", False), Segment(" blue.", True)],
    ),
    "text_mapped_columns": (
        {"question": "2+2=", "answer": "4"},
        {"prompt": "question", "completion": "answer"},
        [Segment("2+2=", False), Segment("4", True)],
    ),
    "conversational": (
        {"prompt": [USER], "completion": [{"role": "assistant", "content": "Hello"}]},
        {},
        [Segment(CHATML_PROMPT, False), Segment("Hello<|im_end|>\n", True)],
    ),
    "conversational_with_system_and_two_completion_turns": (
        {
            "system": "Be brief.",
            "prompt": [USER],
            "completion": [
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"},
            ],
        },
        {},
        [
            Segment("<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML_PROMPT, False),
            Segment(
                "Hello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
                "Ciao<|im_end|>\n",
                True,
            ),
        ],
    ),
}


@pytest.mark.parametrize(
    ("row", "column_map", "expected"), PROMPT_COMPLETION.values(), ids=PROMPT_COMPLETION
)
def test_prompt_completion_segments(row, column_map, expected):
    assert templates.prompt_completion(row, column_map) == expected


PROMPT_COMPLETION_ERRORS = {
    "text_and_turns": (
        {"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]},
        "completion", "wrong_type", "both text or both lists of turns",
    ),
    "empty_completion": ({"prompt": "p", "completion": " "}, "completion", "empty_field", "empty"),
    "missing_completion": ({"prompt": "p"}, "completion", "missing_field", "missing"),
    "prompt_ends_with_the_answer": (
        {"prompt": [USER, {"role": "assistant", "content": "x"}],
         "completion": [{"role": "assistant", "content": "y"}]},
        "prompt[1]", "wrong_type", "last turn is an assistant turn",
    ),
    "completion_without_an_assistant_turn": (
        {"prompt": [USER], "completion": [{"role": "user", "content": "x"}]},
        "completion", "missing_field", "no assistant turn",
    ),
    "unknown_role": (
        {"prompt": [{"role": "human", "content": "Hi"}],
         "completion": [{"role": "assistant", "content": "y"}]},
        "prompt[0]", "wrong_type", "unknown role 'human'",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("row", "field", "reason", "hint"),
    PROMPT_COMPLETION_ERRORS.values(),
    ids=PROMPT_COMPLETION_ERRORS,
)
def test_bad_prompt_completion_rows(row, field, reason, hint):
    with pytest.raises(RowError) as caught:
        templates.prompt_completion(row, {})
    assert (caught.value.field, caught.value.reason) == (field, reason)
    assert hint in str(caught.value)


# Implicit prompts (TRL): no prompt column, chosen and rejected whole; the prompt is what they
# share at the start (TRL's extract_prompt), whole turns for conversations, characters for texts
# with a space before the first difference left to the responses.
ASSISTANT = {"role": "assistant"}
IMPLICIT = {
    "texts_trl_docs_example": (
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        templates.Preference("The sky is", " blue.", " green."),
    ),
    "texts_sharing_a_leading_word_keep_it_in_the_prompt_as_trl": (
        {"chosen": "Q: hi\nA: I can.", "rejected": "Q: hi\nA: I cannot."},
        templates.Preference("Q: hi\nA: I can", ".", "not."),
    ),
    "hh_rlhf_transcripts": (
        {
            "chosen": "\n\nHuman: Hi\n\nAssistant: Hello!",
            "rejected": "\n\nHuman: Hi\n\nAssistant: Go away.",
        },
        templates.Preference("\n\nHuman: Hi\n\nAssistant:", " Hello!", " Go away."),
    ),
    "conversations": (
        {
            "chosen": [USER, {**ASSISTANT, "content": "Hello!"}],
            "rejected": [USER, {**ASSISTANT, "content": "Go away."}],
        },
        templates.Preference(CHATML_PROMPT, "Hello!<|im_end|>\n", "Go away.<|im_end|>\n"),
    ),
    "multi_turn_conversations_share_every_turn_but_the_last": (
        {
            "system": "Be kind.",
            "chosen": [USER, {**ASSISTANT, "content": "Yo"}, USER, {**ASSISTANT, "content": "A"}],
            "rejected": [USER, {**ASSISTANT, "content": "Yo"}, USER, {**ASSISTANT, "content": "B"}],
        },
        templates.Preference(
            "<|im_start|>system\nBe kind.<|im_end|>\n" + CHATML_PROMPT + "Yo<|im_end|>\n"
            + CHATML_PROMPT,
            "A<|im_end|>\n",
            "B<|im_end|>\n",
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize(("row", "expected"), IMPLICIT.values(), ids=IMPLICIT)
def test_implicit_prompt_preference(row, expected):
    assert templates.preference(row, {}) == expected


IMPLICIT_ERRORS = {
    "same_text": ({"chosen": "abc", "rejected": "abc"}, "chosen", "empty_field"),
    "one_text_starts_the_other": ({"chosen": "ab", "rejected": "abc"}, "chosen", "empty_field"),
    "nothing_shared": ({"chosen": "4", "rejected": "5"}, "chosen", "missing_field"),
    "only_a_space_shared": ({"chosen": " a", "rejected": " b"}, "chosen", "missing_field"),
    "text_and_turns": ({"chosen": "a", "rejected": [USER]}, "chosen", "wrong_type"),
    "no_shared_turn": (
        {"chosen": [{**ASSISTANT, "content": "a"}], "rejected": [{**ASSISTANT, "content": "b"}]},
        "chosen", "missing_field",
    ),
    "same_turns": (
        {"chosen": [USER, {**ASSISTANT, "content": "a"}],
         "rejected": [USER, {**ASSISTANT, "content": "a"}]},
        "chosen", "empty_field",
    ),
    "two_turns_after_the_prompt": (
        {"chosen": [USER, {**ASSISTANT, "content": "a"}, USER],
         "rejected": [USER, {**ASSISTANT, "content": "b"}]},
        "chosen[1]", "wrong_type",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("row", "field", "reason"), IMPLICIT_ERRORS.values(), ids=IMPLICIT_ERRORS)
def test_bad_implicit_prompt_rows(row, field, reason):
    with pytest.raises(RowError) as caught:
        templates.preference(row, {})
    assert (caught.value.field, caught.value.reason) == (field, reason)


# message_keys and roles: turns with keys and role names of the dataset's own, read as the
# built-in ones are (the same ChatML text as the OpenAI row).
CUSTOM = templates.Columns(
    {"messages": "dialog"},
    message_keys={"role": "speaker", "content": "text"},
    roles={"USER": "user", "BOT": "assistant"},
)
SHAREGPT_KEYS = templates.Columns(
    message_keys={"role": "from", "content": "value"}, roles={"human": "user", "gpt": "assistant"}
)
MAPPED_TURNS = {
    "chat_custom_keys_and_roles": (
        templates.chat,
        {"dialog": [{"speaker": "USER", "text": "Hi"}, {"speaker": "BOT", "text": "Hello"}]},
        CUSTOM,
        [Segment(CHATML_PROMPT, False), Segment("Hello<|im_end|>\n", True)],
    ),
    "chat_openai_keys_with_a_role_of_its_own": (
        templates.chat,
        {"messages": [USER, {"role": "model", "content": "Hello"}]},
        templates.Columns(roles={"model": "assistant"}),
        [Segment(CHATML_PROMPT, False), Segment("Hello<|im_end|>\n", True)],
    ),
    "prompt_completion_sharegpt_turns": (
        templates.prompt_completion,
        {"prompt": [{"from": "human", "value": "Hi"}],
         "completion": [{"from": "gpt", "value": "Hello"}]},
        SHAREGPT_KEYS,
        [Segment(CHATML_PROMPT, False), Segment("Hello<|im_end|>\n", True)],
    ),
    "preference_implicit_sharegpt_turns": (
        templates.preference,
        {"chosen": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}],
         "rejected": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Go away."}]},
        SHAREGPT_KEYS,
        templates.Preference(CHATML_PROMPT, "Hello!<|im_end|>\n", "Go away.<|im_end|>\n"),
    ),
    "preference_prompt_and_responses_with_custom_keys": (
        templates.preference,
        {"prompt": [{"speaker": "USER", "text": "Hi"}],
         "chosen": {"speaker": "BOT", "text": "Hello!"},
         "rejected": [{"speaker": "BOT", "text": "Go away."}]},
        CUSTOM,
        templates.Preference(CHATML_PROMPT, "Hello!<|im_end|>\n", "Go away.<|im_end|>\n"),
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("template", "row", "columns", "expected"), MAPPED_TURNS.values(), ids=MAPPED_TURNS
)
def test_mapped_turn_keys_and_roles(template, row, columns, expected):
    assert template(row, columns) == expected
    # guard: without the mapping the same row is refused (the mapping is what read it)
    with pytest.raises(RowError):
        template(row, dict(columns))  # a plain dict: the keys and roles are not carried


def test_an_unmapped_role_is_named_with_the_roles_known():
    row = {"dialog": [{"speaker": "USER", "text": "Hi"}, {"speaker": "BOT2", "text": "Hello"}]}
    with pytest.raises(RowError) as caught:
        templates.chat(row, CUSTOM)
    assert caught.value.field == "dialog[1]"
    assert "unknown role 'BOT2'" in str(caught.value) and "'BOT'" in str(caught.value)
