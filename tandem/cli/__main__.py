"""`python -m tandem.cli`: the `tandem` command, as the launcher starts processes."""

from tandem.cli import main

main()
