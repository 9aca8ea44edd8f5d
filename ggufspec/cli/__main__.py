"""`python -m ggufspec.cli`: the `ggufspec` command, as the scripts and tests run it from a checkout."""

from . import main

main()
