"""The bottom layer, below the plugin (fairseq_rope) and the tools (fairseq_rope_tools), standard
library only: atomic files (:mod:`.files`), the one error class (:mod:`.errors`) and the text step
both the plugin's tokenizer and the recipe's steps run (:mod:`.text`). Both
packages import it; it imports neither, so the plugin imports nothing of the tools, and the
tools that must not load torch import nothing of the plugin."""
