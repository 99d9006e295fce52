"""fairseq-rope-user-dir: print the plugin's directory, for fairseq's --user-dir.

    fairseq-train DATA --user-dir "$(fairseq-rope-user-dir)" --arch transformer_rope ...

works from any working directory and for a regular or an editable install, where the bare name
``--user-dir fairseq_rope`` is found only in the working directory or next to fairseq's own
package. From Python: ``from fairseq_rope_tools.user_dir import plugin_dir``, then
``TransformerModel.from_pretrained(..., user_dir=plugin_dir())``.
"""

from fairseq_rope_tools.cli import ArgumentParser, command, plugin_dir

__all__ = ["plugin_dir", "main"]


@command
def main(argv=None) -> None:
    p = ArgumentParser(prog="fairseq-rope-user-dir", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.parse_args(argv)
    print(plugin_dir())


if __name__ == "__main__":
    main()
