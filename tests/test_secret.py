"""Where the job secret comes from and what is refused (lightning_ft/secret.py)."""
from __future__ import annotations

import os

import pytest

from lightning_ft import secret
from lightning_ft.secret import REDACTED, SecretError, resolve

GOOD = "0123456789abcdef0123"


def test_resolve_order_config_then_file_then_variable(tmp_path):
    f = tmp_path / "s"
    f.write_text("from-the-file-0123456789\n")
    env = {"LFT_SECRET_FILE": str(f), "LFT_SECRET": "from-the-variable-0123456789"}
    assert resolve(GOOD, env) == GOOD
    assert resolve("", env) == "from-the-file-0123456789"
    assert resolve(REDACTED, env) == "from-the-file-0123456789", "the redacted marker is never the secret"
    assert resolve("", {"LFT_SECRET": "from-the-variable-0123456789"}) == "from-the-variable-0123456789"
    assert resolve("", {}, required=False) == ""


@pytest.mark.parametrize("configured,env,words", [
    ("", {}, ["no job secret", "LFT_SECRET_FILE"]),
    (REDACTED, {}, ["redacted placeholder", "LFT_SECRET_FILE"]),
    ("short", {}, ["5 characters", "at least 16"]),
    ("", {"LFT_SECRET": "tiny"}, ["$LFT_SECRET is 4 characters"]),
    ("", {"LFT_SECRET_FILE": "/nonexistent/secret"}, ["cannot read the secret file", "/nonexistent/secret"]),
])
def test_refusals_say_what_to_do_and_never_show_the_value(configured, env, words):
    with pytest.raises(SecretError) as e:
        resolve(configured, env)
    for w in words:
        assert w in str(e.value)
    for value in ("short", "tiny"):
        assert f"'{value}'" not in str(e.value)


def test_short_secret_in_a_file_is_refused(tmp_path):
    f = tmp_path / "s"
    f.write_text("abc\n")
    with pytest.raises(SecretError, match="3 characters"):
        resolve("", {"LFT_SECRET_FILE": str(f)})


def test_write_file_is_owner_only_and_not_overwritten(tmp_path):
    path = str(tmp_path / "secret")
    secret.write_file(path, GOOD)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert secret.read_file(path) == GOOD
    with pytest.raises(FileExistsError):
        secret.write_file(path, "another-secret-0123456789")


def test_tag_tells_secrets_and_jobs_apart_without_revealing_them():
    t = secret.tag(GOOD, "gpt")
    assert t == secret.tag(GOOD, "gpt") and len(t) == 16
    assert t != secret.tag(GOOD + "x", "gpt") and t != secret.tag(GOOD, "gpt2")
    assert GOOD not in t
    assert len(secret.generate()) == 32 and secret.generate() != secret.generate()


def test_docs_and_examples_never_put_a_secret_on_a_command_line():
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = ["README.md", "docs/GUIDE.md", "docs/ARCHITECTURE.md", "examples/slurm/train.sbatch"]
    for path in paths:
        text = open(os.path.join(root, path)).read()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) if path.endswith(".md") else [text]
        for line in (l for b in blocks for l in b.splitlines()):
            assert not re.search(r"(^|\s)(ft\.)?secret=|LFT_SECRET=\S", line), f"{path}: a secret in: {line}"
    readme = open(os.path.join(root, "README.md")).read()
    assert "export LFT_SECRET_FILE=" in readme
