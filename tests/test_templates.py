"""Tests for rayjobs.templates: literal segment tables per template, RowError cases, prefix
stability."""

from __future__ import annotations

import pytest

from rayjobs import templates
from rayjobs.templates import RowError, Segment

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
            # function_call is an assistant turn (trained); observation is a tool turn (not).
            Segment('{"name": "w"}<|im_end|>\n', True),
            Segment('<|im_start|>tool\n{"t": 20}<|im_end|>\n<|im_start|>assistant\n', False),
            Segment("It is 20.<|im_end|>\n", True),
        ],
    ),
}


@pytest.mark.parametrize("row, expected", list(CHAT.values()), ids=list(CHAT))
def test_chat_segments_with_chatml(row, expected):
    segments = templates.chat(row, {}, templates.chatml)
    assert segments == expected
    # The segments partition the full rendering: nothing lost, nothing repeated.
    assert "".join(s.text for s in segments) == templates.chatml(
        templates.chat_messages(row, {}), False
    )


def test_sharegpt_roles_normalise_to_openai_roles():
    row = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "H"},
            {"from": "gpt", "value": "G"},
            {"from": "function_call", "value": "F"},
            {"from": "observation", "value": "O"},
            {"from": "user", "value": "U"},
            {"from": "assistant", "value": "A"},
            {"from": "tool", "value": "T"},
        ]
    }
    assert templates.chat_messages(row, {}) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "H"},
        {"role": "assistant", "content": "G"},
        {"role": "assistant", "content": "F"},
        {"role": "tool", "content": "O"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "T"},
    ]


def _chat_with_chatml(row, column_map):
    return templates.chat(row, column_map, templates.chatml)


USER = {"role": "user", "content": "Hi"}
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
        templates.chat_messages,
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
    "chat_openai_tool_call_turn_is_refused_not_trained_empty": (
        _chat_with_chatml,
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "w"}}],
                },
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."},
            ]
        },
        {},
        "messages[1]",
        "carries 'tool_calls'",
    ),
    "chat_openai_function_call_turn": (
        _chat_with_chatml,
        {"messages": [USER, {"role": "assistant", "content": "x", "function_call": {"name": "w"}}]},
        {},
        "messages[1]",
        "carries 'function_call'",
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
    "prompt_ends_with_the_answer": (
        {"prompt": [USER, {"role": "assistant", "content": "x"}], "chosen": "c", "rejected": "r"},
        "prompt",
        "wrong_type",
    ),
    "bad_prompt_turn": (
        {"prompt": [{"role": "alien", "content": "x"}], "chosen": "c", "rejected": "r"},
        "prompt",
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
