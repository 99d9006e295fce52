"""The one entry point of every fairseq-rope-* command (``fairseq_rope_tools.cli.command``) and
the output rule's check (``files.outputs_over_inputs_problem``): how a command ends when the user
must change something, when its reader goes away, when it is terminated."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fairseq_rope_base.files import outputs_over_inputs_problem
from fairseq_rope_tools.cli import CommandFailed, UserError, command

pytestmark = pytest.mark.fast


def test_a_user_error_is_one_line_with_its_status(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fairseq-rope-demo"])

    @command
    def refuses(argv):
        raise UserError("--flag x: give y")

    @command
    def fails(argv):
        raise CommandFailed("fairseq-train exited with status 1; its last lines:\n    boom\nfull log: a.log")

    with pytest.raises(SystemExit) as stopped:
        refuses([])
    assert stopped.value.code == 2 and capsys.readouterr().err == "fairseq-rope-demo: error: --flag x: give y\n"
    with pytest.raises(SystemExit) as stopped:
        fails([])
    assert stopped.value.code == 1 and capsys.readouterr().err.startswith("fairseq-rope-demo: error: fairseq-train")
    assert command(lambda argv: 3)([]) == 3 and command(lambda argv: None)([]) is None


def test_the_plugin_and_the_tools_raise_one_error_class(capsys, monkeypatch):
    """fairseq_rope_base.errors.OneLineError is the base of the tools' UserError and of the plugin's
    errors, whose modules need no torch to say so: a command reports any of them in one line."""
    from fairseq_rope_base.errors import OneLineError

    monkeypatch.setattr(sys, "argv", ["fairseq-rope-demo"])
    assert issubclass(UserError, OneLineError) and issubclass(CommandFailed, OneLineError)

    class PluginOptionError(OneLineError, ValueError):  # as fairseq_rope.config_values.OptionError
        pass

    @command
    def bad_option(argv):
        raise PluginOptionError("--rope-theta must be a finite positive number, got 0")

    with pytest.raises(SystemExit) as stopped:
        bad_option([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "fairseq-rope-demo: error: --rope-theta must be a finite positive number, got 0\n"


def test_other_exceptions_keep_their_traceback():
    @command
    def broken(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        broken([])


def run_script(body, **kwargs):
    """A command whose main runs ``body``, started as a console script would be."""
    script = "\n".join(["import sys, time", "from fairseq_rope_tools.cli import command", "@command",
                        "def main(argv=None):", textwrap.indent(textwrap.dedent(body).strip(), "    "),
                        "sys.exit(main())"])
    return subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_reader_that_goes_away_ends_the_command_quietly():
    writer = run_script("""
        for i in range(100000):
            print("line", i)
    """, stdout=subprocess.PIPE)
    writer.stdout.readline()
    writer.stdout.close()  # as `| head -1` does
    assert writer.wait(timeout=60) == 128 + signal.SIGPIPE
    assert writer.stderr.read() == ""


def test_a_closed_standard_output_is_named_before_any_work():
    proc = subprocess.run([sys.executable, "-c", "from fairseq_rope_tools.cli import closed_stdout_problem; "
                           "import sys; sys.stderr.write(str(closed_stdout_problem('-o')))"],
                          stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1))
    assert proc.stderr == "standard output is closed: give -o FILE, or run the command with stdout open"
    assert __import__("fairseq_rope_tools.cli").cli.closed_stdout_problem("-o") is None


def test_sigterm_unwinds_and_exits_143(tmp_path):
    marker = tmp_path / "cleaned"
    proc = run_script(f"""
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").close()
    """, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143 and marker.exists()


def test_outputs_over_inputs(tmp_path):
    (tmp_path / "work" / "bpe").mkdir(parents=True)
    text = tmp_path / "in.en"
    text.write_text("a\n")
    link = tmp_path / "link.en"
    link.symlink_to(text)
    problem = outputs_over_inputs_problem({"-o": link}, {"INPUT": text})
    assert problem.startswith(f"-o {link} is INPUT {text}") and "\n" not in problem
    assert "holds --raw-dir" in outputs_over_inputs_problem({"--out-dir": tmp_path / "work"},
                                                               {"--raw-dir": tmp_path / "work" / "bpe"})
    # beside each other, or the output inside the input directory: nothing is overwritten
    assert outputs_over_inputs_problem({"-o": tmp_path / "out.de"}, {"INPUT": text, "--model": None}) is None
    assert outputs_over_inputs_problem({"--out-dir": tmp_path / "work" / "bpe" / "x"},
                                       {"--raw-dir": tmp_path / "work"}) is None
