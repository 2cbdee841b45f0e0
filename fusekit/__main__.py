"""``python -m fusekit`` runs the command-line interface."""

from fusekit._cli.app import main

main()
