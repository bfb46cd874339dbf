"""`python -m fedprivacy` is the `fedprivacy` command."""

from fedprivacy.cli import main

main()
