"""A config's own templates (``template_modules``) and turn settings (``message_keys``, ``roles``):
imported and checked before Ray starts, refused naming the key; a user template tokenizes in a
fresh process that never imported its module (what a Tokenize actor on another node is)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import GPT2
from rayjobs.config import ConfigError, load_config
from rayjobs.data import templates

MODULE = '''
from rayjobs.data.templates import Segment, register_template, text_field

PREFIX = "Q: "


@register_template("{name}", fields=("question", "answer"))
def qa(row, column_map, render_chat=None):
    """A question and its answer; only the answer trains."""
    question = text_field(row, "question", column_map)
    return [Segment(PREFIX + question + "\\nA:", False),
            Segment(" " + text_field(row, "answer", column_map), True)]
'''


def _config(tmp_path: Path, template: str, modules: object, **dataset) -> Path:
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    path = tmp_path / "run.yaml"
    spec = {"name": "qa", "source": str(data), "template": template, **dataset}
    raw = {"datasets": [spec], "tokenizer": {"path": str(GPT2)}}
    if modules is not None:
        raw["template_modules"] = modules
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def registry():
    """The registry as it was: a test's templates are removed after it."""
    before = dict(templates.TEMPLATES)
    yield
    templates.TEMPLATES.clear()
    templates.TEMPLATES.update(before)


def test_a_module_beside_the_config_registers_a_template_that_tokenizes_elsewhere(
    tmp_path, registry
):
    (tmp_path / "qa_templates_a.py").write_text(MODULE.format(name="qa_a"))
    config = load_config(_config(tmp_path, "qa_a", ["qa_templates_a"]))
    assert config.template_modules == ["qa_templates_a"]
    import ray.cloudpickle

    from rayjobs.data.stream import shipped_templates

    shipped = ray.cloudpickle.dumps((shipped_templates(config), config.datasets[0]))
    # A fresh interpreter, without the config's folder on its path, as a Tokenize actor is.
    code = textwrap.dedent(f"""
        import json, sys, ray.cloudpickle
        from rayjobs.config import TokenizerConfig
        from rayjobs.data.sources import record_table
        from rayjobs.data.tokenize import Tokenize
        registry, spec = ray.cloudpickle.loads(sys.stdin.buffer.read())
        assert "qa_templates_a" not in sys.modules
        tokenize = Tokenize([spec], TokenizerConfig(path={str(GPT2)!r}), 64, "truncate",
                            registry=registry)
        row = json.dumps({{"question": "2+2?", "answer": "4"}})
        table = tokenize(record_table("qa", [spec.files[0]], [1], [row]))
        print(json.dumps(table.column("labels").to_pylist()[0]))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], input=shipped, capture_output=True, cwd=Path.home()
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    labels = json.loads(done.stdout)
    from tokenizers import Tokenizer

    gpt2 = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    trained = [label for label in labels if label != -100]
    assert trained == gpt2.encode(" 4").ids + [50256]  # the answer and EOS, nothing else


BAD_MODULES = {
    "not_a_list": ("qa", "my_templates", "template_modules: expected a list of module names"),
    "not_found": ("qa", ["no_such_module_here"], "template_modules.0: no module"),
    "raises_on_import": (
        "qa", ["broken_templates"], "template_modules.0: importing 'broken_templates' raised",
    ),
    "imports_what_is_not_installed": (
        "qa", ["needy_templates"], "template_modules.0: importing 'needy_templates' failed",
    ),
    "registers_nothing": ("qa", ["empty_templates"], "registers no template"),
    "declares_no_fields": ("loose", ["loose_templates"], "declares no fields"),
    "wrong_signature": ("narrow", ["narrow_templates"], "must take (row, column_map, render_chat)"),
    "template_not_registered_without_the_module": ("qa_b", None, "unknown template 'qa_b'"),
}  # fmt: skip

FILES = {
    "broken_templates.py": "raise RuntimeError('no')\n",
    "needy_templates.py": "import not_installed_anywhere\n",
    "empty_templates.py": "X = 1\n",
    "loose_templates.py": (
        "from rayjobs.data.templates import register_template\n"
        "@register_template('loose')\ndef loose(row, column_map, render_chat=None):\n"
        "    return []\n"
    ),
    "narrow_templates.py": (
        "from rayjobs.data.templates import register_template\n"
        "@register_template('narrow', fields=('text',))\ndef narrow(row):\n    return []\n"
    ),
    "qa_templates_b.py": MODULE.format(name="qa_b"),
}


@pytest.mark.parametrize(("template", "modules", "message"), BAD_MODULES.values(), ids=BAD_MODULES)
def test_bad_template_modules_are_refused_naming_the_key(
    tmp_path, registry, template, modules, message
):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, template, modules))
    assert message in str(caught.value)


def test_a_module_of_the_same_name_in_another_folder_is_imported_from_there(tmp_path, registry):
    """Two configs, each with its own ``qa_templates_c.py``: each run gets its own."""
    for folder, prefix in (("one", "Q: "), ("two", "Question: ")):
        (tmp_path / folder).mkdir()
        module = MODULE.format(name="qa_c").replace('PREFIX = "Q: "', f"PREFIX = {prefix!r}")
        (tmp_path / folder / "qa_templates_c.py").write_text(module)
        config = load_config(_config(tmp_path / folder, "qa_c", ["qa_templates_c"]))
        render = templates.TEMPLATES[config.datasets[0].template].render
        segments = render({"question": "q", "answer": "a"}, {}, None)
        assert segments[0].text == f"{prefix}q\nA:"


TURN_SETTINGS = {
    "message_keys_on_a_template_without_turns": (
        "alpaca", {"message_keys": {"role": "from"}}, "apply to templates that read conversation",
    ),
    "an_unknown_message_key": (
        "chat", {"message_keys": {"speaker": "from"}}, "message_keys names the keys",
    ),
    "a_role_mapped_to_an_unknown_role": (
        "chat", {"roles": {"bot": "robot"}}, "a role maps to one of system, user, assistant, tool",
    ),
    "axolotl_roles_form": (
        "chat", {"roles": {"user": ["human"]}}, "Axolotl's {user: [human]} is written",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("template", "dataset", "message"), TURN_SETTINGS.values(), ids=TURN_SETTINGS
)
def test_bad_turn_settings_are_refused(tmp_path, template, dataset, message):
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, template, None, **dataset))
    assert message in str(caught.value) and "datasets.0" in str(caught.value)


def test_turn_settings_reach_the_template(tmp_path):
    config = load_config(
        _config(tmp_path, "chat", None, message_keys={"role": "from"}, roles={"bot": "assistant"})
    )
    columns = config.datasets[0].columns
    assert (columns.message_keys, columns.roles) == ({"role": "from"}, {"bot": "assistant"})


def test_submit_ships_the_template_module_with_the_config_or_refuses(tmp_path, registry):
    """The job's driver imports the module again on the cluster, from the upload."""
    from rayjobs.job import submit

    project = tmp_path / "proj"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "qa_templates_d.py").write_text(MODULE.format(name="qa_d"))
    shutil.copytree(GPT2, project / "tok")
    config = _config(project / "configs", "qa_d", ["qa_templates_d"])
    raw = yaml.safe_load(config.read_text())
    raw["tokenizer"]["path"] = "../tok"
    raw["datasets"][0]["source"] = "qa.jsonl"
    config.write_text(yaml.safe_dump(raw))
    plan = submit.plan_submission(config, working_dir=project)
    assert "configs/qa_templates_d.py" in submit.shipped_files(
        project, plan.runtime_env["excludes"]
    )
    (project / ".gitignore").write_text("*.py\n")
    with pytest.raises(submit.SubmitError) as caught:
        submit.plan_submission(config, working_dir=project)
    assert "template_modules.0 ('qa_templates_d'" in str(caught.value)
    assert "is left out of the upload (configs/qa_templates_d.py" in str(caught.value)
