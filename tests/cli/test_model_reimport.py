"""Registering a model again after editing its chat template says that its id changed, and what
that does to the peers still running with the old files (issue 46, item 6).

A model id covers every file of the model: a swarm chains only peers and requesters with
identical files. Editing a template and importing the folder again gave the model a new id,
silently: the peers still running stopped matching whatever was started after.
"""

from __future__ import annotations

from tessera.peer.cli.main import main
from tessera.peer.cli.model_files import synthesise


def test_an_edited_chat_template_changes_the_id_and_import_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "registry"))
    src = synthesise(tmp_path / "src", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=300, seed=1)
    (src / "manifest.json").unlink()  # a Hugging Face folder as a user has it
    assert main(["model", "import", str(src), "--name", "mine"]) == 0
    first = capsys.readouterr()
    assert "model id changed" not in first.err
    assert main(["model", "import", str(src), "--name", "mine"]) == 0  # the same files again: nothing to say
    assert "model id changed" not in capsys.readouterr().err

    with open(src / "chat_template.jinja", "a") as template:
        template.write("{# a house style #}\n")
    assert main(["model", "import", str(src), "--name", "mine"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("note: mine's model id changed, ") and "(changed: chat_template.jinja)" in err, err
    assert "peers still running with the old files no longer chain with requesters or peers started now" in err
